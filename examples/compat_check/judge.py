"""The English judge of sharded runs: a small causal LM scores a continuation for fluent English,
paired with word-level checks (unknown words, repetition) that perplexity alone misses."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JudgeLimits:
    """What the English verdict asks of a generation. Calibrated with SmolLM2-135M as the judge: a
    simple fluent sentence scores 10-80, Austen passages cut mid-sentence 60-235 (measured on the
    offline corpus), keyboard gibberish 600-1,100, word-shuffled text 5,000+ (offline-assets.md).
    Repetition ("the the the") scores deceptively low, hence the word-level signals beside it."""
    max_perplexity: float = 250.0
    min_words: int = 8
    max_oov_rate: float = 0.15  # share of words wordfreq does not know in English
    min_distinct_bigrams: float = 0.6  # distinct word bigrams / all word bigrams (repetition)


class EnglishJudge:
    """A small causal LM on CPU that scores a continuation for fluent English."""

    def __init__(self, model_dir: str | os.PathLike, limits: JudgeLimits = JudgeLimits()):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir, self.limits = str(model_dir), limits
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # Start-of-document marker: <|endoftext|> where the vocabulary has one (SmolLM2: id 0).
        eot = self.tok.convert_tokens_to_ids("<|endoftext|>")
        self.start_id = eot if isinstance(eot, int) and eot != self.tok.unk_token_id else (
            self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id)

    def perplexity(self, text: str, context: str = "") -> float:
        """Perplexity of `text` given `context` (the prompt), over the text's tokens only."""
        import torch

        ctx = [self.start_id, *self.tok.encode(context, add_special_tokens=False)]
        ids = self.tok.encode(text, add_special_tokens=False)
        if not ids:
            return float("inf")
        inp = torch.tensor([ctx + ids])
        labels = torch.tensor([[-100] * len(ctx) + ids])
        with torch.no_grad():
            return float(self.model(inp, labels=labels).loss.exp())

    def judge(self, text: str, prompt: str = "") -> dict[str, Any]:
        import wordfreq

        words = wordfreq.tokenize(text, "en")
        alpha = [w for w in words if any(ch.isalpha() for ch in w)]
        oov = sum(wordfreq.zipf_frequency(w, "en") == 0 for w in alpha) / max(len(alpha), 1)
        bigrams = list(zip(words, words[1:]))
        distinct = len(set(bigrams)) / len(bigrams) if bigrams else 0.0
        ppl = self.perplexity(text, prompt)
        lim = self.limits
        reasons = []
        if len(words) < lim.min_words:
            reasons.append(f"{len(words)} words < {lim.min_words}")
        if not ppl <= lim.max_perplexity:
            reasons.append(f"perplexity {ppl:.1f} > {lim.max_perplexity}")
        if oov > lim.max_oov_rate:
            reasons.append(f"out-of-vocabulary words {oov:.0%} > {lim.max_oov_rate:.0%}")
        if distinct < lim.min_distinct_bigrams:
            reasons.append(f"distinct bigrams {distinct:.2f} < {lim.min_distinct_bigrams} (repetition)")
        return {"english": not reasons, "perplexity": ppl, "words": len(words), "oov_rate": oov,
                "distinct_bigrams": distinct, "reasons": reasons, "judge_model": self.model_dir}
