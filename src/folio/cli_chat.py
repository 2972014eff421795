"""The terminal side of `folio generate` and `folio chat`.

stream_outputs drives the engine for one request and can stop it between
steps; Chat keeps a conversation's history and its /commands. Ctrl-C during a
reply stops that reply only: the partial text stays in the history and the
prompt comes back. No torch import: `folio chat --help` stays fast.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from typing import Callable, Iterator, Optional

CHAT_USAGE = ("type a message; /history shows the conversation, /reset starts over; "
              "Ctrl-C stops a reply; /exit or Ctrl-D quits")
COMMANDS = ("/history", "/reset", "/exit", "/quit")


def stream_outputs(engine, request_id: str, prompt_ids: list[int], params,
                   stop: Callable[[], bool] = lambda: False) -> Iterator:
    """Drive the engine for one request, yielding its CompletionOutput after each step.

    Checks `stop()` between steps, never inside one; the request is aborted
    (its blocks freed) when stopped or when the caller closes the iterator.
    """
    engine.add_tokenized_request(request_id, None, prompt_ids, params)
    try:
        while engine.has_unfinished_requests() and not stop():
            for out in engine.step():
                if out.request_id == request_id:
                    yield out.outputs[0]
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request([request_id])


def print_stream(outputs: Iterator) -> Optional[object]:
    """Write each output's new text to stdout as it comes, then a newline; the last output."""
    sent, last = 0, None
    for last in outputs:
        sys.stdout.write(last.text[sent:])
        sys.stdout.flush()
        sent = len(last.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return last


def read_message() -> Optional[str]:
    """The next line typed at the prompt, None at the end of input; Ctrl-C here asks again."""
    while True:
        try:
            return read_line("> ")
        except EOFError:
            return None
        except KeyboardInterrupt:
            print("\n(Ctrl-C stops a reply; /exit or Ctrl-D quits)", file=sys.stderr)


def read_line(prompt: str) -> str:
    """input(), except that Ctrl-C interrupts it on a terminal even after torch started threads.

    The kernel may hand SIGINT to one of torch's threads; then a read()
    blocked in the main thread never returns EINTR and Python, which runs
    signal handlers in the main thread only, raises KeyboardInterrupt only
    after Enter. Waiting in short select() calls gives it the chance.
    """
    if os.name != "posix" or not sys.stdin.isatty():
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    fd = sys.stdin.fileno()
    while not select.select([fd], [], [], 0.1)[0]:
        pass
    data = os.read(fd, 65536)      # a terminal in line mode returns one line per read
    if not data:            # Ctrl-D: end the prompt's line before the shell's comes
        sys.stdout.write("\n")
        raise EOFError
    return data.decode(sys.stdin.encoding or "utf-8", errors="replace").rstrip("\n")


class StopOnInterrupt:
    """Inside `with`, Ctrl-C (SIGINT) sets `stopped` instead of raising KeyboardInterrupt.

    A KeyboardInterrupt raised inside engine.step() could leave the scheduler
    between schedule() and update_from_output(); a flag read between steps
    stops a reply and leaves the engine whole for the next one.
    """

    def __enter__(self) -> "StopOnInterrupt":
        self.stopped = False
        self._previous = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.stopped = True

    def is_set(self) -> bool:
        return self.stopped

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


class Chat:
    """One conversation: its history, the /commands, and replies that Ctrl-C can stop."""

    def __init__(self, engine, tokenizer, params, system: Optional[str]):
        if tokenizer.chat_template is None:
            raise ValueError("the model's tokenizer has no chat template: use folio generate")
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.start = [{"role": "system", "content": system}] if system else []
        self.history = list(self.start)
        self.turns = 0

    def handle(self, line: str) -> bool:
        """Act on one line typed at the prompt; False to quit. A line that starts
        with / is a command, never sent to the model (a mistyped one would be);
        // sends the line from its second /."""
        text = line.strip()
        command = text.split()[0] if text.startswith("/") else None
        if command in ("/exit", "/quit"):
            return False
        if command == "/reset":
            self.history = list(self.start)
        elif command == "/history":
            self.show_history()
        elif text.startswith("//"):
            self.reply(line.lstrip()[1:])
        elif command:
            print(f"unknown command {command}; commands: {', '.join(COMMANDS)} (// sends a "
                  f"message that starts with /)", file=sys.stderr)
        elif text:
            self.reply(line)
        return True

    def reply(self, message: str) -> None:
        self.history.append({"role": "user", "content": message})
        self.turns += 1
        try:
            prompt = self.tokenizer.encode_chat(self.history)
            with StopOnInterrupt() as interrupt:
                last = print_stream(stream_outputs(self.engine, f"chat-{self.turns}", prompt,
                                                   self.params, interrupt.is_set))
        except ValueError as e:     # e.g. the conversation outgrew the context
            self.history.pop()
            print(f"folio: {e} (/reset starts over)", file=sys.stderr)
            return
        # A stopped reply stays in the history: the next message may refer to it.
        self.history.append({"role": "assistant", "content": last.text if last else ""})
        note = reply_note(last, interrupt.stopped, self.params.max_tokens)
        if note:
            print(note, file=sys.stderr)

    def show_history(self) -> None:
        for message in self.history:
            print(f"[{message['role']}] {message['content']}")
        if not self.history:
            print("(no messages yet)")


def reply_note(last, interrupted: bool, max_tokens: Optional[int]) -> Optional[str]:
    """Why a reply ended early, or None when the model ended it."""
    if last is not None and last.finish_reason == "length":
        if max_tokens is not None and len(last.token_ids) >= max_tokens:
            return f"[reply cut at --max-tokens {max_tokens}]"
        return "[reply cut: the conversation fills the context; /reset starts over]"
    if interrupted and (last is None or not last.finished):
        return "[reply stopped]"
    return None
