"""NKIRoPE: torchtitan's CosSinRoPE running the `qwen3_recipes::rope_fwd` op, swapped in through
torchtitan's own override (replacement) registry (torchtitan/config/override.py).

    from common.kernels import rope_module
    entry = rope_module.register("*layers.1.*")         # which RoPE modules: an fnmatch glob on the FQN
    trainer_config.override.imports = [(entry, {"lnc": 2, "check_kernel_shape": True})]

torchtitan applies the override before it builds the model and logs one line per replaced module:
    [Override] common.kernels.rope_module.nki_rope: model_spec.model.layers.1.attention.rope CosSinRoPE.Config -> NKIRoPE.Config
The FQN starts at the config root: `model_spec.model.layers.N.attention.rope` under the trainer,
`layers.N.attention.rope` when the model config itself is the root. A bare `layers.1...` therefore
matches nothing in a training run; start globs with `*` (`*layers.1.*`, `*layers.[0-3].*`).

From torchtitan's own CLI, `--override.imports common.kernels.rope_module.nki_rope` replaces every layer
(the module registers that override when imported).

NKIRoPE keeps CosSinRoPE's Config fields and cache, so checkpoints and `from_hf` see a CosSinRoPE.
It never indexes the cache with positions (no gather, which Trainium runs poorly): with no
positions it slices the first `seq` rows; with per-token positions (torchtitan's packed documents
restart at 0) it computes those rows from the positions with the same float32 arithmetic as the
cache, so the rows are the ones a gather would fetch. The first layer of a forward computes them,
the other layers reuse them (the same positions tensor reaches every layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.config import derive, override
from torchtitan.models.common.rope import CosSinRoPE, _yarn_inv_freq

from common.errors import UserError
from common.kernels.rope_op import rope

__all__ = ["NKIRoPE", "nki_rope", "register", "clear_rows_cache", "ALL_LAYERS"]

ALL_LAYERS = "*"


class NKIRoPE(CosSinRoPE):
    """CosSinRoPE whose rotation (forward and backward) is the rope custom op."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        lnc: int = 2  # the kernel's launch grid; must equal NEURON_LOGICAL_NC_CONFIG on Trainium
        check_kernel_shape: bool = False  # also enforce the NKI shape rule off Trainium

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        seq = query.shape[1]
        if seq > self.cache.shape[0]:
            raise UserError(f"sequence length {seq} is longer than the RoPE cache ({self.cache.shape[0]} positions, "
                            "the model's max_seq_len)")
        table = self.cache[:seq] if positions is None else self._rows_once_per_forward(positions)
        if table.dim() == 3 and table.shape[0] == 1:
            table = table[0]  # one set of positions for the whole batch
        return rope(query, key, table, lnc=self.config.lnc, check_kernel_shape=self.config.check_kernel_shape)

    def _rows_once_per_forward(self, positions: torch.Tensor) -> torch.Tensor:
        """rows_for(positions), computed by the first layer of a forward and reused by the others:
        every layer gets the same `positions` tensor, and the rows depend only on it and the RoPE
        settings. The entry holds that tensor, so its identity cannot be reused by another one; an
        in-place change bumps its version and misses."""
        global _rows_entry
        if torch.compiler.is_compiling():  # --compile: a layer's graph computes its rows (a cache compared by
            return self.rows_for(positions)  # identity would be a guard failing every step: a recompile each step)
        key = (positions._version, self._rows_settings())
        if _rows_entry is not None and _rows_entry[0] is positions and _rows_entry[1] == key:
            return _rows_entry[2]
        table = self.rows_for(positions)
        _rows_entry = (positions, key, table)
        return table

    def _rows_settings(self) -> tuple:
        c = self.config
        return (c.dim, c.theta, c.scaling, c.rope_factor, c.beta_fast, c.beta_slow, c.original_seq_len, c.truncate)

    def rows_for(self, positions: torch.Tensor) -> torch.Tensor:
        """cat(cos, sin) for per-token `positions` [batch or 1, seq] -> [batch or 1, seq, 2 * dim].

        Same float32 steps as CosSinRoPE._precompute_cache (position x inv_freq, then cos and sin),
        on the positions instead of arange(max_seq_len): the rows `cache[positions]` would return."""
        cfg = self.config
        if cfg.scaling == "yarn" and cfg.rope_factor > 1.0:
            inv_freq = _yarn_inv_freq(cfg.dim, cfg.theta, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow,
                                      cfg.original_seq_len, cfg.truncate)
        else:
            inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, cfg.dim, 2)[: (cfg.dim // 2)].float() / cfg.dim))
        inv_freq = inv_freq.to(positions.device)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        freqs = positions.to(inv_freq.dtype).unsqueeze(-1) * inv_freq  # = torch.outer, row by row
        theta = torch.cat([freqs, freqs], dim=-1)
        return torch.cat([theta.cos(), theta.sin()], dim=-1)


_rows_entry: tuple | None = None  # (positions, key, rows): the latest forward's table, shared by the layers


def clear_rows_cache() -> None:
    """Forget the shared table (benchmarks time a first layer with it)."""
    global _rows_entry
    _rows_entry = None


def nki_rope(cfg: CosSinRoPE.Config, *, lnc: int = 2, check_kernel_shape: bool = False) -> NKIRoPE.Config:
    """Override factory: the matched CosSinRoPE config becomes an NKIRoPE config (same fields)."""
    return derive(cfg, NKIRoPE.Config, lnc=lnc, check_kernel_shape=check_kernel_shape)


# Every layer, for `--override.imports common.kernels.rope_module.nki_rope` on torchtitan's own CLI.
override(target=CosSinRoPE.Config, exact=True,
         description="RoPE custom op (NKI rope_hf on Trainium), every layer")(nki_rope)


def nki_rope_selected(cfg: CosSinRoPE.Config, *, lnc: int = 2,
                      check_kernel_shape: bool = False) -> NKIRoPE.Config:
    """Override factory for the layers chosen by `register(pattern)`."""
    return nki_rope(cfg, lnc=lnc, check_kernel_shape=check_kernel_shape)


_selected_pattern: str | None = None


def register(layers: str = ALL_LAYERS) -> str:
    """Return the `override.imports` target that replaces the RoPE modules whose FQN matches the
    glob `layers` (`*`: every layer). A narrower glob registers its own override once per process:
    torchtitan's registry fixes the FQN globs when an override is registered."""
    global _selected_pattern
    if not layers:
        raise UserError("--rope_layers is empty; give a glob such as '*' or '*layers.1.*'")
    if layers == ALL_LAYERS:
        return f"{__name__}.nki_rope"
    if _selected_pattern is None:
        override(target=CosSinRoPE.Config, fqns=[layers], exact=True,
                 description=f"RoPE custom op (NKI rope_hf on Trainium), layers {layers}")(nki_rope_selected)
        _selected_pattern = layers
    elif _selected_pattern != layers:
        raise UserError(f"RoPE layers already registered as {_selected_pattern!r} in this process; "
                        f"cannot switch to {layers!r}")
    return f"{__name__}.nki_rope_selected"
