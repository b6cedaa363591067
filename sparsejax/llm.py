"""Text in, text out: `LLM(path_or_id, method=...).generate(prompts) -> completions`."""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from sparsejax import methods as M
from sparsejax.generate import generate
from sparsejax.models import from_pretrained, load_tokenizer
from sparsejax.models.loading import checkpoint_dir


class LLM:
    """A checkpoint (directory or Hub id), its tokenizer and a decoding method.

    method: None (dense), a method of `sparsejax.methods`, or a `methods.REGISTRY` name, run
    at `budget_ratio` of each row's own length (so a prompt's completion does not depend on
    the prompts batched with it) with what ships beside the checkpoint
    (`methods.fitted_beside`; `calibrated=False` keeps the defaults scaled to the depth).
    """

    def __init__(self, path_or_id: str | Path, *, method=None, dtype=jnp.float32,
                 budget_ratio: float = 0.1, calibrated: bool = True):
        if isinstance(method, str) and method not in M.REGISTRY:
            raise ValueError(f"method={method!r}: expected a method or one of {tuple(M.REGISTRY)}")
        if not 0 < budget_ratio <= 1:
            raise ValueError(f"budget_ratio={budget_ratio}: expected 0 < budget_ratio <= 1")
        self.path = checkpoint_dir(path_or_id)
        self.model = from_pretrained(self.path, dtype=dtype)
        self.tokenizer = load_tokenizer(self.path)
        self.method, self.budget_ratio = method, budget_ratio
        self.fitted = (M.fitted_beside(self.path, self.model, calibrated)
                       if isinstance(method, str) else None)

    def method_for(self, context: int | None = None):
        """The method run on every prompt. A registry name's budget is a ratio of each row's
        own length, so the method is the same for any `context` (kept for older callers)."""
        if not isinstance(self.method, str):
            return self.method
        return M.REGISTRY[self.method].at_budget(self.model.config, M.Ratio(self.budget_ratio),
                                                 self.fitted)

    def generate(self, prompts: list[str], max_new_tokens: int = 64, **kwargs) -> list[str]:
        """Complete each prompt (batched together, right-padded); `kwargs` go to
        `sparsejax.generate` (temperature, top_k, top_p, eos_token_id, rng, page_size)."""
        if isinstance(prompts, str) or not prompts:
            raise ValueError(f"prompts={prompts!r}: expected a non-empty list of strings")
        rows = [self.tokenizer(p)["input_ids"] for p in prompts]
        lengths = np.asarray([len(r) for r in rows], np.int32)
        ids = np.zeros((len(rows), lengths.max()), np.int32)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = row
        out = generate(self.model, ids, lengths=lengths, max_new_tokens=max_new_tokens,
                       method=self.method_for(), **kwargs)
        tokens, num = np.asarray(out.tokens), np.asarray(out.num_generated)
        return [self.tokenizer.decode(t[:n], skip_special_tokens=True)
                for t, n in zip(tokens, num)]
