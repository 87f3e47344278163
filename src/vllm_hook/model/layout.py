"""Where each (site, layer) is physically captured: one column of the capture index per point,
writing into one of three pools by row width: the residual width (resid_*, attn_out, mlp_out),
the query width (q) and the key width (k).

`resid_pre` of layer L >= 1 is `resid_post` of layer L-1 (the same tensor: what layer L reads),
so only the embedding output (resid_pre of layer 0) needs a point of its own. `attn_scores`
points are virtual: they have no column; the runtime computes them after the forward from
the captured q and the paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRASH_ROWS = 64  # rows nobody reads; spread so that many discarded rows do not hit one address
POOL_RESID, POOL_Q, POOL_K = 0, 1, 2


@dataclass(frozen=True)
class PointTable:
    num_layers: int
    sites: tuple[str, ...]
    site_layers: tuple[int, ...] | None = None    # layers of the opt-in sites (None: all)
    cols: dict = field(init=False)
    pool: dict = field(init=False)
    writer: dict = field(init=False)               # point -> the decoder layer whose forward writes it
    n_points: int = field(init=False)

    def __post_init__(self):
        L = self.num_layers
        cols: dict[tuple[str, int], int] = {("resid_post", i): i for i in range(L)}
        pool = {i: POOL_RESID for i in range(L)}
        writer = {i: i for i in range(L)}
        nxt = L

        def add(site: str, layer: int, p: int) -> None:
            nonlocal nxt
            cols[(site, layer)] = nxt
            pool[nxt] = p
            writer[nxt] = layer          # resid_pre 0 (the embeddings): layer 0's forward
            nxt += 1

        if "resid_pre" in self.sites:
            add("resid_pre", 0, POOL_RESID)
            for i in range(1, L):
                cols[("resid_pre", i)] = i - 1
        opt_layers = range(L) if self.site_layers is None else sorted(set(self.site_layers))
        for site, p in (("attn_out", POOL_RESID), ("mlp_out", POOL_RESID), ("q", POOL_Q), ("k", POOL_K)):
            if site in self.sites:
                for i in opt_layers:
                    add(site, i, p)
        n_points = nxt
        if "q" in self.sites:
            for i in opt_layers:
                cols[("attn_scores", i)] = n_points + i   # virtual
        object.__setattr__(self, "cols", cols)
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "writer", writer)
        object.__setattr__(self, "n_points", n_points)

    @classmethod
    def for_config(cls, num_layers: int, cfg) -> "PointTable":
        layers = cfg.layers_of(cfg.site_layers, num_layers)
        return cls(num_layers, tuple(cfg.sites), None if len(layers) == num_layers else tuple(sorted(layers)))

    def col(self, site: str, layer: int) -> int:
        return self.cols[(site, layer)]

    def has(self, site: str, layer: int) -> bool:
        return (site, layer) in self.cols

    def pool_of(self, col: int) -> int:
        return self.pool[col]
