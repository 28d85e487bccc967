"""SFT records -> token ids + a loss mask, once: the one renderer of `data prepare` and of the node's raw reader.

Two formats ([data] format, `hpctrain data prepare --format`):

- ``alpaca``: records ``{"instruction", "input" (optional), "output"}``. The prompt is the Stanford Alpaca
  template (PROMPT / PROMPT_NO_INPUT below) after bos (when the tokenizer has one); the response is
  ``output`` + eos. Prompt and response are encoded separately, so the mask is exact at the seam.
- ``chat``: records whose ``messages`` field is a list of ``{"role", "content"}`` (OpenAI style), rendered
  with the tokenizer's own ``chat_template`` (transformers' apply_chat_template). A template with
  ``{% generation %}`` blocks gives its assistant mask directly (return_assistant_tokens_mask); any other is
  rendered prefix by prefix: turn i's span is the text between the render of messages[:i] with the
  generation prompt and the render of messages[:i+1] (trailing whitespace left out), and a token is trained
  when it overlaps a span (offsets of one tokenization of the whole conversation, so the ids are exactly
  those of apply_chat_template). A template that rewrites earlier turns (the prefix is not a prefix) fails
  the record as `template_error`, never guesses.

The mask is True on the tokens the loss covers (the response + eos, the assistant turns); everything else
gets label -100. `overlong`: an example longer than seq_len is cut to seq_len ("truncate": the prompt stays,
the response is cut; an example whose prompt leaves no response token is dropped) or dropped ("drop").
Bad records are counted by reason (`Tally`), never trained on and never fatal one by one; a file of which
every record is bad is refused by the caller (`Tally.all_bad`).

numpy and transformers are imported inside functions: the CLI path imports this module for its names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

FORMATS = ("alpaca", "chat")
OVERLONG = ("truncate", "drop")
ROLES = ("system", "user", "assistant", "tool")

PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = ("Below is an instruction that describes a task. "
                   "Write a response that appropriately completes the request.\n\n"
                   "### Instruction:\n{instruction}\n\n### Response:\n")

# Why a record was not trained on; the order is the report's.
REASONS: dict[str, str] = {
    "not_json": "not valid JSON",
    "not_object": "not a JSON object",
    "missing_field": "a required field is missing or empty",
    "not_string": "a field or a message's content is not a string",
    "bad_message": "a message is not a {role, content} object",
    "unknown_role": f"a role other than {'/'.join(ROLES)}",
    "no_assistant": "no assistant turn",
    "empty_response": "an empty response",
    "overlong": "longer than seq_len (dropped)",
    "template_error": "the chat template failed on it",
}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Bad(Exception):
    """One record that is not trained on: `reason` is a key of REASONS, `why` the detail."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason, self.why = reason, why


class SftInputError(ValueError):
    """The data or tokenizer cannot be used for this format at all (callers turn it into their usage error)."""


@dataclass
class Tally:
    """Records read, kept and truncated, bad ones by reason with the first of each ("where: why")."""

    records: int = 0
    kept: int = 0
    truncated: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)
    earliest: str = ""  # the first bad record of all, "where: why (reason)"

    def add_bad(self, reason: str, where: str, why: str) -> None:
        self.bad[reason] = self.bad.get(reason, 0) + 1
        self.first.setdefault(reason, f"{where}: {why}")
        self.earliest = self.earliest or f"{where}: {why} ({reason})"

    @property
    def bad_total(self) -> int:
        return sum(self.bad.values())

    def all_bad(self) -> bool:
        return self.records > 0 and self.kept == 0

    def merge(self, other: Tally) -> Tally:
        self.records += other.records
        self.kept += other.kept
        self.truncated += other.truncated
        for r, n in other.bad.items():
            self.bad[r] = self.bad.get(r, 0) + n
        for r, w in other.first.items():
            self.first.setdefault(r, w)
        self.earliest = self.earliest or other.earliest
        return self

    def to_json(self) -> dict[str, Any]:
        return {"records": self.records, "kept": self.kept, "truncated": self.truncated,
                "bad": {r: self.bad[r] for r in REASONS if r in self.bad},
                "first": {r: self.first[r] for r in REASONS if r in self.first}, "earliest": self.earliest}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> Tally:
        d = d or {}
        return cls(records=int(d.get("records", 0)), kept=int(d.get("kept", 0)), truncated=int(d.get("truncated", 0)),
                   bad={str(k): int(v) for k, v in dict(d.get("bad", {})).items()},
                   first={str(k): str(v) for k, v in dict(d.get("first", {})).items()},
                   earliest=str(d.get("earliest", "")))

    def table(self, seq_len: int = 0) -> list[str]:
        """The report as aligned lines (what `data prepare` prints and rank 0 logs)."""
        cut = f" ({self.truncated:,} cut to seq_len {seq_len})" if self.truncated and seq_len else \
            (f" ({self.truncated:,} truncated)" if self.truncated else "")
        lines = [f"records: {self.records:,} read, {self.kept:,} trained on{cut}, {self.bad_total:,} bad"]
        for r, what in REASONS.items():
            if r in self.bad:
                lines.append(f"  {r:<15} {self.bad[r]:>9,}  {what}; first: {self.first.get(r, '')}")
        return lines


@dataclass
class Encoding:
    """What the renderer needs of a tokenizer: text -> ids (no special tokens), bos/eos, and for chat the
    transformers tokenizer whose chat_template renders conversations."""

    encode: Callable[[str], list[int]]
    bos_id: int | None
    eos_id: int | None
    chat: Any = None


def check_chat_tokenizer(chat: Any, name: str) -> None:
    """A tokenizer that can render chat: a transformers tokenizer with a chat_template."""
    if chat is None:
        raise SftInputError(f"[data] tokenizer = {name!r}: format \"chat\" renders conversations with the "
                            "tokenizer's chat_template, and the byte tokenizer has none. Fix: set [data] tokenizer "
                            "(--tokenizer) to a local tokenizer folder with a chat_template, or use format \"alpaca\"")
    if not getattr(chat, "chat_template", None):
        raise SftInputError(f"[data] tokenizer = {name!r}: has no chat_template (tokenizer_config.json "
                            "\"chat_template\" or chat_template.jinja), and format \"chat\" renders conversations "
                            "with it. Fix: use the instruct model's tokenizer folder, add a chat_template to this "
                            "one, or use format \"alpaca\"")


class Renderer:
    """Records of one format -> (ids, mask) arrays of at most seq_len tokens, or `Bad`."""

    def __init__(self, fmt: str, enc: Encoding, seq_len: int, overlong: str = "truncate",
                 messages_field: str = "messages") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"not an SFT format: {fmt!r}")
        self.fmt, self.enc, self.seq_len, self.overlong = fmt, enc, seq_len, overlong
        self.messages_field = messages_field
        self.generation = fmt == "chat" and bool(_GENERATION.search(str(getattr(enc.chat, "chat_template", "") or "")))

    def render(self, rec: Any) -> tuple[np.ndarray, np.ndarray, bool]:
        """(ids int64, mask bool, truncated); raises Bad."""
        import numpy as np

        if not isinstance(rec, dict):
            raise Bad("not_object", f"a JSON {type(rec).__name__}, not an object")
        ids, mask = self._alpaca(rec) if self.fmt == "alpaca" else self._chat(rec)
        cut = False
        if len(ids) > self.seq_len:
            if self.overlong == "drop":
                raise Bad("overlong", f"{len(ids)} tokens > seq_len {self.seq_len} (overlong = \"drop\")")
            ids, mask, cut = ids[:self.seq_len], mask[:self.seq_len], True
            if not any(mask):
                raise Bad("overlong", f"the prompt alone fills seq_len {self.seq_len}: no response token is left")
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool), cut

    # ----------------------------------------------------------------------------------------- alpaca
    def _alpaca(self, rec: dict[str, Any]) -> tuple[list[int], list[bool]]:
        for key in ("instruction", "output"):
            if key not in rec or rec[key] is None:
                raise Bad("missing_field", f"no {key!r} (it has: {', '.join(sorted(map(str, rec))) or 'nothing'})")
        for key in ("instruction", "input", "output"):
            if rec.get(key) is not None and not isinstance(rec[key], str):
                raise Bad("not_string", f"{key!r} is {json_kind(rec[key])}, not a string")
        if not rec["instruction"].strip():
            raise Bad("missing_field", "'instruction' is empty")
        if not rec["output"].strip():
            raise Bad("empty_response", "'output' is empty")
        extra = rec.get("input") or ""
        prompt = (PROMPT if extra.strip() else PROMPT_NO_INPUT).format(instruction=rec["instruction"], input=extra)
        e = self.enc
        head = ([e.bos_id] if e.bos_id is not None else []) + e.encode(prompt)
        tail = e.encode(rec["output"]) + ([e.eos_id] if e.eos_id is not None else [])
        return head + tail, [False] * len(head) + [True] * len(tail)

    # ------------------------------------------------------------------------------------------- chat
    def _messages(self, rec: dict[str, Any]) -> list[dict[str, Any]]:
        f = self.messages_field
        if f not in rec:
            raise Bad("missing_field", f"no {f!r} (it has: {', '.join(sorted(map(str, rec))) or 'nothing'})")
        msgs = rec[f]
        if not isinstance(msgs, list) or not msgs:
            raise Bad("missing_field", f"{f!r} is not a non-empty list of messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise Bad("bad_message", f"message {i} is not a {{role, content}} object")
            if m["role"] not in ROLES:
                raise Bad("unknown_role", f"message {i} has role {m['role']!r}")
            if not isinstance(m["content"], str):
                raise Bad("not_string", _not_string(i, m))
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not turns:
            raise Bad("no_assistant", f"{len(msgs)} message(s), none with role 'assistant'")
        for i in turns:
            if not msgs[i]["content"].strip():
                raise Bad("empty_response", f"message {i} (assistant) is empty")
        return msgs

    def _chat(self, rec: dict[str, Any]) -> tuple[list[int], list[bool]]:
        msgs = self._messages(rec)
        tok = self.enc.chat
        try:
            if self.generation:
                out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
                ids = list(out["input_ids"])
                return ids, [bool(m) for m in out["assistant_masks"]]
            text, spans = self._spans(msgs)
        except Bad:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception, a jinja error: this record's fault
            raise Bad("template_error", f"{type(exc).__name__}: {exc}") from None
        import numpy as np

        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(offsets), dtype=bool)
        for s, e in spans:  # a token is trained when it overlaps an assistant span
            mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
        return list(enc["input_ids"]), mask.tolist()

    def _spans(self, msgs: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and the character span of every assistant turn in it."""
        def render(upto: int, gen: bool) -> str:
            return str(self.enc.chat.apply_chat_template(msgs[:upto], tokenize=False, add_generation_prompt=gen))

        full = render(len(msgs), False)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            turn = render(i + 1, False)
            head = self._head(render, i, turn, m["content"])
            if not turn.startswith(head) or not full.startswith(turn):
                raise Bad("template_error", f"the template renders turn {i} differently once later turns follow "
                                            "(no prefix to mask by); give it {% generation %} blocks")
            end = len(head) + len(turn[len(head):].rstrip())
            spans.append((len(head), end))
        return full, spans

    @staticmethod
    def _head(render: Callable[[int, bool], str], i: int, turn: str, content: str) -> str:
        """The text before turn i's response: messages[:i] and the assistant header (add_generation_prompt).
        A conversation that opens with the assistant has no prefix to render (transformers refuses an empty
        one): its header is the text of the turn before its content, which is prompt, never response."""
        if i:
            return render(i, True)
        at = turn.find(content.strip())
        if at < 0:
            raise Bad("template_error", "the template changes the first (assistant) message's text, so its header "
                                        "cannot be told apart: start with a user or system message, or give the "
                                        "template {% generation %} blocks")
        return turn[:at]


def _not_string(i: int, m: dict[str, Any]) -> str:
    """Why message i's content is refused, naming the OpenAI shapes a user most likely has."""
    content = m["content"]
    if isinstance(content, list):
        return (f"message {i}'s content is a list (OpenAI content parts), not a string: join its text parts into "
                "one string; images and other parts cannot be trained on")
    if content is None and m.get("tool_calls"):
        return f"message {i} ({m['role']}) has tool_calls and no content string: tool calls are not trained on"
    return f"message {i}'s content is {json_kind(content)}, not a string"


def json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (the user wrote JSON, not Python): 'a number', 'an object', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    return "a list" if isinstance(value, list) else f"a {type(value).__name__}"


def parse_line(line: bytes | str) -> Any:
    """A jsonl line as a record; raises Bad("not_json")."""
    text = line.rstrip(b"\r\n") if isinstance(line, bytes) else line.rstrip("\r\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:  # the line is the file's (FILE:LINE): where in it, not "line 2 column 1"
        raise Bad("not_json", f"{exc.msg} at character {exc.pos + 1} of the line") from None
    except ValueError as exc:  # bytes that are not UTF-8
        raise Bad("not_json", str(exc)) from None


def render_into(renderer: Renderer, rec: Any, where: str, tally: Tally) -> tuple[np.ndarray, np.ndarray] | None:
    """Render one record (a parsed record, or Bad from parsing), counting it; None when it is not trained on."""
    tally.records += 1
    try:
        if isinstance(rec, Bad):
            raise rec
        ids, mask, cut = renderer.render(rec)
    except Bad as bad:
        tally.add_bad(bad.reason, where, bad.why)
        return None
    tally.kept += 1
    tally.truncated += int(cut)
    return ids, mask


def signed(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """One int64 array for the node's batcher: trained tokens as their id, the others as -(id + 1)."""
    import numpy as np

    ids = ids.astype(np.int64, copy=False)
    return np.where(mask, ids, -ids - 1)


def all_bad_message(path: str, tally: Tally) -> str:
    """`FIELD = VALUE: why. Fix: ...` for a file none of whose records can be trained on."""
    return (f"[data] source = {path!r}: none of its {tally.records:,} records can be trained on; the first bad one: "
            f"{tally.earliest}. Fix: check the file against the format (docs/data.md), or [data] format / "
            "messages_field / seq_len")
