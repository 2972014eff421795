"""Request fields of OpenAI, vLLM and SGLang that Folio does not have: each
with the values that mean "not used" (accepted), any other value a 400 naming
the field (server/protocol.py's request models refuse them)."""

from __future__ import annotations

_NONE, _NONE_OR_EMPTY = (None,), (None, [])
NOT_YET: dict[str, tuple] = {
    # vLLM's older names of structured_outputs' fields
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "guided_decoding_backend", "structural_tag",
                     "truncate_prompt_tokens", "prompt_logprobs", "mm_processor_kwargs",
                     "kv_transfer_params", "cache_salt", "vllm_xargs", "request_id"), _NONE),
    **dict.fromkeys(("tools", "functions", "allowed_token_ids", "bad_words",
                     "logits_processors"), _NONE_OR_EMPTY),
    "tool_choice": (None, "none"), "function_call": (None, "none"),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True),
    # SGLang's fields, which vllm-router writes into every request it forwards
    "no_stop_trim": (None, False), "return_hidden_states": (None, False),
    "separate_reasoning": (None, True), "stream_reasoning": (None, True),
}
NOT_YET_COMPLETION = {**NOT_YET, "suffix": (None, ""), "prompt_embeds": _NONE,
                       "add_special_tokens": (None, True)}
NOT_YET_CHAT = {**{k: v for k, v in NOT_YET.items() if k not in ("tools", "tool_choice")},
                 "documents": _NONE_OR_EMPTY, "reasoning_effort": _NONE,
                 "audio": _NONE, "modalities": (None, ["text"]), "prediction": _NONE,
                 "web_search_options": _NONE, "add_special_tokens": (None, False)}
