"""Where each (site, layer) is physically captured: one column of the capture index per point.

`resid_pre` of layer L >= 1 is `resid_post` of layer L-1 (the same tensor: what layer L reads),
so only the embedding output (resid_pre of layer 0) needs a point of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRASH_ROWS = 64  # rows nobody reads; spread so that many discarded rows do not hit one address


@dataclass(frozen=True)
class PointTable:
    num_layers: int
    sites: tuple[str, ...]
    cols: dict = field(init=False)
    n_points: int = field(init=False)

    def __post_init__(self):
        cols: dict[tuple[str, int], int] = {("resid_post", L): L for L in range(self.num_layers)}
        nxt = self.num_layers
        if "resid_pre" in self.sites:
            cols[("resid_pre", 0)] = nxt
            nxt += 1
            for L in range(1, self.num_layers):
                cols[("resid_pre", L)] = L - 1
        for site in ("attn_out", "mlp_out"):
            if site in self.sites:
                for L in range(self.num_layers):
                    cols[(site, L)] = nxt
                    nxt += 1
        object.__setattr__(self, "cols", cols)
        object.__setattr__(self, "n_points", nxt)

    def col(self, site: str, layer: int) -> int:
        return self.cols[(site, layer)]

    def has(self, site: str, layer: int) -> bool:
        return (site, layer) in self.cols
