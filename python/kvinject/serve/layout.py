"""Prompt building: the model's chat template rendered once around a marker.

A memory prompt is, in token ids, ``[header | fact ... | tail]``:

- the chat template (transformers ``apply_chat_template`` of the model
  directory) renders a conversation whose first message is the gateway's
  system message, ``"<system prompt>\\n<memory heading>\\n" + MARKER`` (then
  the client's leading system messages, joined by newlines), followed by the
  client's other messages and the generation prompt;
- ``header``: the rendered text before the marker, tokenized alone (the same
  for every user: each replica keeps a copy per user as the user's fact 0);
- each fact: ``"- <text>\\n"`` tokenized alone, once, when the fact is added
  (its ids are stored, so they never change);
- ``tail``: the rendered text after the marker, tokenized alone.

Tokenizing the parts apart keeps every fact a span of whole tokens whatever
surrounds it; the ids the replica sees are exactly these (the gateway sends
token ids, never text), so a plain prefill of the same ids is the reference.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Sequence, Tuple

MARKER = "\u27e6kvinject-memory\u27e7"


def message_text(content: Any) -> str:
    """A message's content as text: a string, or OpenAI's list of parts of
    which the text parts are joined (other kinds are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("content[%d]: only text parts ({\"type\": \"text\", \"text\": ...}) are "
                                 "supported" % i)
            out.append(p["text"])
        return "".join(out)
    if content is None:
        return ""
    raise ValueError("content must be a string or a list of text parts")


class Layout:
    def __init__(self, model_dir: str, system_prompt: str, memory_heading: str):
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("%s: the tokenizer has no chat template" % model_dir)
        self.system_prompt = system_prompt
        self.memory_heading = memory_heading
        self.system_head = "%s\n%s\n" % (system_prompt, memory_heading)
        text = self._render([], "")
        self.header = self.encode(text.split(MARKER)[0])
        if not self.header:
            raise ValueError("the memory header renders to no tokens")
        h = hashlib.sha256(json.dumps({"header": self.header, "fact": self.fact_tokens("x"),
                                       "tail": self.tail([{"role": "user", "content": "x"}])[0]}).encode())
        #: changes when the prompt layout changes (system prompt, heading, tokenizer, template)
        self.hash = h.hexdigest()[:16]

    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_token(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def fact_tokens(self, text: str) -> List[int]:
        """A fact's token ids as it appears in a memory prompt."""
        return self.encode("- %s\n" % text)

    def _render(self, messages: List[Dict[str, str]], client_system: str) -> str:
        sys_msg = self.system_head + MARKER + ("\n" + client_system if client_system else "")
        conv = [{"role": "system", "content": sys_msg}] + messages
        text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        if text.count(MARKER) != 1:
            raise ValueError("the chat template does not render the system message once (the marker appears "
                             "%d times)" % text.count(MARKER))
        return text

    def tail(self, messages: Sequence[Dict[str, Any]]) -> Tuple[List[int], str]:
        """The tail's token ids for a client's messages (role, content), and
        the last user message's text (the retrieval query). Leading system
        messages join the gateway's system message after the memories."""
        msgs = [{"role": m["role"], "content": message_text(m.get("content"))} for m in messages]
        lead = []
        while msgs and msgs[0]["role"] in ("system", "developer"):
            lead.append(msgs.pop(0)["content"])
        for m in msgs:
            if m["role"] == "developer":
                m["role"] = "system"
        text = self._render(msgs, "\n".join(lead))
        query = next((m["content"] for m in reversed(msgs) if m["role"] == "user"), "")
        return self.encode(text.split(MARKER, 1)[1]), query

    def prompt(self, facts: Sequence[Sequence[int]], tail: Sequence[int]) -> List[int]:
        ids = list(self.header)
        for f in facts:
            ids += list(f)
        return ids + list(tail)
