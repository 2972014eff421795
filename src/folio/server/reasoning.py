"""`--reasoning-parser qwen3`: a chat answer's thinking, between `<think>` and
`</think>`, goes to the message's `reasoning_content` (and the stream's
`delta.reasoning_content`), the rest to its `content`, as vLLM serves them.

Where the thinking begins is read from the prompt: Qwen3's templates leave the
assistant's turn open and the model writes `<think>` itself; the thinking-only
models (Qwen3-*-Thinking-2507) end the prompt with `<think>`, so the answer
begins inside the thinking; `enable_thinking: false` ends it with an empty
`<think></think>`, so the answer is content. An answer that opens no thinking
is content, whole and unchanged; one that writes `<think>` after a prompt
that opened it has that tag dropped. One whose thinking never closes (cut
by max_tokens) is all reasoning, streamed or not.

The thinking is stripped of the whitespace around it, the content of the
whitespace it begins with (Qwen3 writes `<think>\\n...\\n</think>\\n\\n`).
A growing answer is split so that what may still change is held back: a
tail that could begin `</think>`, an opening that could still be `<think>`,
whitespace that may turn out to end the thinking. So each piece a stream
sends is the start of what the finished answer's split says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

OPEN, CLOSE = "<think>", "</think>"
_PROMPT_TAIL = 8        # prompt tokens read back to see whether it ends inside <think>


@dataclass(frozen=True)
class Split:
    reasoning: Optional[str]    # None: the answer has no thinking
    content: str
    thinking: bool = False      # still inside the thinking (its end not written yet)


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at text's end could be the start of tag."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


@dataclass(frozen=True)
class ThinkParser:
    """Splits one answer; `inside`: the prompt ended inside the thinking."""
    inside: bool = False

    @classmethod
    def for_prompt(cls, tokenizer, prompt_ids: Sequence[int]) -> "ThinkParser":
        tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL:]), skip_special_tokens=False)
        return cls(inside=tail.rstrip().endswith(OPEN))

    def split(self, text: str, final: bool = True) -> Split:
        """The answer's thinking and content; with final False (it may grow), only
        what no later text can change."""
        body, lead = text, text.lstrip()
        if not lead.startswith(OPEN) and not final and OPEN.startswith(lead):
            # may still become <think>: opening the thinking, or (inside) repeating it
            return Split("", "", thinking=True) if self.inside else Split(None, "")
        if lead.startswith(OPEN):           # inside too: a model that writes it again
            body = lead[len(OPEN):]
        elif not self.inside:
            return Split(None, text)
        end = body.find(CLOSE)
        if end < 0:
            if not final:
                body = body[:len(body) - _partial_tail(body, CLOSE)]
                # trailing whitespace may be the thinking's last: held back by strip
            return Split(body.strip(), "", thinking=True)
        content = body[end + len(CLOSE):].lstrip()
        return Split(body[:end].strip(), content)
