"""Every prompt the engine tests send, by name: a stored prefix of corpus tokens, then new tokens.

One engine without the connector computes the cold tokens of all of them once per session
(the ``cold`` fixture); each test compares its engine's tokens with those. The prompts
are cut from distinct stretches of the corpus, so no two share a block by accident.
"""
from __future__ import annotations

from dataclasses import dataclass

from tests.store.engines.vllm.harness import corpus_line, segment, tokenizer


@dataclass(frozen=True)
class Prompt:
    """``stored`` corpus tokens from ``start`` (what ``prefill warm`` is given), then ``new`` more."""

    name: str
    start: int
    stored: int
    new: int

    @property
    def prefix(self) -> list[int]:
        return segment(self.start, self.stored)

    @property
    def ids(self) -> list[int]:
        return segment(self.start, self.stored + self.new)


def _chain(specs: list[tuple[str, int, int]], start: int) -> dict[str, Prompt]:
    out: dict[str, Prompt] = {}
    for name, stored, new in specs:
        out[name] = Prompt(name, start, stored, new)
        start += stored + new + 7  # a gap: the next prompt starts mid-sentence, elsewhere
    return out


PROMPTS: dict[str, Prompt] = _chain([
    # same tokens (bf16 and FP8 stores): two kvwarm blocks + 100 new; three blocks and nothing new
    # (vLLM must compute one token: 640 of the 768 load, half of the last kvwarm block); one block
    ("two_blocks", 512, 100), ("three_blocks_exact", 768, 0), ("one_block", 256, 44),
    ("short", 200, 0),  # no full kvwarm block: nothing to load
    # write-back, then a restarted engine
    ("written_back", 0, 700),
    # never fail: each prefix stored, then broken one way
    ("corrupt", 512, 60), ("expired", 512, 60), ("other_model", 512, 60), ("other_tenant", 512, 60),
    ("s3_hit", 512, 60), ("s3_down", 512, 60),
    # isolation: tenant A's prefix, a public prefix; one nobody stores (a miss to compare refusals with)
    ("tenant_a", 512, 80), ("public", 512, 80), ("unstored", 512, 60),
], start=0)

#: keys: a corpus prompt stored by `prefill warm --chat --text` (as a system message), then a user turn;
#: another stored by `prefill warm --text` and sent as text, which vLLM tokenises itself
CHAT_LINE, TEXT_LINE, TEXT_SUFFIX_LINE = 291, 274, 288


def chat_prefix_ids() -> list[int]:
    """``CHAT_LINE`` through the tiny model's chat template, as ``prefill warm --chat`` encodes it."""
    ids = tokenizer().apply_chat_template([{"role": "system", "content": corpus_line(CHAT_LINE)}], tokenize=True,
                                          add_generation_prompt=False)
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def chat_ids() -> list[int]:
    user = tokenizer()("<|user|>\n" + corpus_line(TEXT_SUFFIX_LINE)[:300], add_special_tokens=False)["input_ids"]
    return chat_prefix_ids() + [int(t) for t in user]


def text_prompt() -> str:
    return corpus_line(TEXT_LINE) + "\n" + corpus_line(TEXT_SUFFIX_LINE)


def text_ids() -> list[int]:
    return [int(t) for t in tokenizer()(text_prompt(), add_special_tokens=False)["input_ids"]]

#: token agreement (FP8 storage, and bf16 beyond the few prompts above): 16 prompts of one stored block
AGREE = _chain([(f"agree_{i}", 256, 44) for i in range(16)], start=20000)

#: concurrency: 8 prompts sharing one stored 512-token prefix, 8 with nothing stored
SHARED = Prompt("shared", 30000, 512, 0)
CONCURRENT_SHARED = [Prompt(f"shared_{i}", 30000, 512, 40 + 9 * i) for i in range(8)]
CONCURRENT_COLD = _chain([(f"cold_{i}", 0, 300 + 20 * i) for i in range(8)], start=33000)


#: prompts whose prefixes the bf16 (and the FP8) store holds; "short" has no full kvwarm block
SAME = ["two_blocks", "three_blocks_exact", "one_block", "short", *AGREE]


def stored_prefix(name: str) -> list[int]:
    """The prefix ``prefill warm`` is given for a prompt (empty when it has no full kvwarm block)."""
    p = PROMPTS.get(name) or AGREE[name]
    return p.prefix if p.stored >= 256 else []


def concurrent_shared_ids() -> dict[str, list[int]]:
    """The shared prefix, then a distinct suffix per prompt (cut from elsewhere in the corpus)."""
    return {p.name: SHARED.prefix + segment(36500 + 97 * i, p.new) for i, p in enumerate(CONCURRENT_SHARED)}


#: no poison: rounds x prefixes x requests per prefix (the first loads it, the others share its blocks
#: through vLLM's prefix cache), each a stored 512-token prefix then 300 new tokens (one more full kvwarm block)
POISON_ROUNDS, POISON_PREFIXES, POISON_SHARERS = 3, 16, 3
POISON_STORED, POISON_NEW = 512, 300


def poison_prefix(i: int) -> list[int]:
    return segment(10000 + 600 * i, POISON_STORED)


def poison_ids() -> dict[str, list[int]]:
    """``poison_<round>_<prefix>_<request>``: a stored prefix, then new tokens cut from elsewhere in the corpus."""
    out: dict[str, list[int]] = {}
    k = 0
    for r in range(POISON_ROUNDS):
        for i in range(POISON_PREFIXES):
            for j in range(POISON_SHARERS):
                out[f"poison_{r}_{i}_{j}"] = poison_prefix(i) + segment(1000 + 211 * k, POISON_NEW)
                k += 1
    return out


def all_ids() -> dict[str, list[int]]:
    """The token ids of every prompt, by name (what the ``cold`` fixture runs)."""
    out = {name: p.ids for name, p in PROMPTS.items()}
    out.update({name: p.ids for name, p in CONCURRENT_COLD.items()})
    out.update({name: p.ids for name, p in AGREE.items()})
    out.update(concurrent_shared_ids())
    out.update(chat=chat_ids(), text=text_ids())
    out.update(poison_ids())
    return out
