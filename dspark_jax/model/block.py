"""One DeepSeek-V4 block: mHC around attention and around the MoE.

X -> hc_pre(attn) -> attn_norm -> attention -> hc_post -> hc_pre(ffn) -> ffn_norm -> MoE -> hc_post

With ``Numerics.sinkhorn="fused"`` the steps between the sub-blocks run as fused kernels
(``pallas_kernels.hc_fused``): hc_pre + attn_norm in two launches, hc_post + hc_pre + ffn_norm in
two, the last hc_post in one, or (``Block.unexpanded``, the model's layer loop) in the next
block's first two with its hc_pre + attn_norm.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from dspark_jax.cache import LayerCache
from dspark_jax.config import ModelConfig
from dspark_jax.model.attention import Attention
from dspark_jax.model.common import Chunk, Numerics
from dspark_jax.model.hyper import hc_head, hc_post, hc_post_pre_norm, hc_pre_norm, hc_unit_params
from dspark_jax.model.moe import MoE
from dspark_jax.model.norms_rope import RMSNorm
from dspark_jax.sharding import per_request
from pallas_kernels.gemv import Partials, total


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pending:
    """A sub-block's output f not yet expanded into the streams, with its hc_post weights."""

    f: Float[Array, "b t d"]
    post: Float[Array, "b t n"]
    comb: Float[Array, "b t n n"]


def mhc_mesh(owner) -> Mesh | None:
    """The mesh on which ``owner``'s fused mHC kernels run per device, each on its own requests (a
    ``pallas_call`` has no partitioning rule), or None: one device, or plain JAX, which the
    partitioner splits. ``owner`` (a Block or the model) has ``num`` and ``mesh`` (set by
    ``dspark_jax.sharding.attach_mesh``)."""
    return owner.mesh if owner.num.mhc_fused() else None


def hc_head_of(owner, x: Float[Array, "b t n d"], norm: RMSNorm | None = None) -> Float[Array, "b t d"]:
    """``hc_head`` with ``owner``'s head parameters (the model's, or the last drafter stage's),
    followed by ``norm`` when given."""
    c = owner.cfg
    norm_args = () if norm is None else (norm.weight[...],)

    def head(fn, base, scale, *rest):
        *w, x = rest
        return hc_head(x, fn, base, scale, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps, fused=owner.num.mhc_fused(),
                       norm_weight=w[0] if w else None, out_eps=None if norm is None else norm.eps)

    return per_request(head, mhc_mesh(owner), x,
                       replicated=(owner.hc_head_fn[...], owner.hc_head_base[...], owner.hc_head_scale[...],
                                   *norm_args))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, num: Numerics, *, ratio: int, hash_routing: bool, rngs: nnx.Rngs):
        d, n = cfg.hidden_size, cfg.hc_mult
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, ratio, num, rngs=rngs)
        self.ffn = MoE(cfg, hash_routing, num, rngs=rngs)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = hc_unit_params(rngs, n, d, (2 + n) * n)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = hc_unit_params(rngs, n, d, (2 + n) * n)
        self.cfg, self.num = cfg, num
        self.mesh = None  # set by ``dspark_jax.sharding.attach_mesh``: fused mHC kernels then run per device

    def _unit_kw(self, norm: RMSNorm) -> dict:
        c = self.cfg
        return dict(iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps, out_eps=norm.eps,
                    sinkhorn_impl=self.num.sinkhorn_impl())

    def post(self, f: Float[Array, "b t d"], x: Float[Array, "b t n d"], post: Float[Array, "b t n"],
             comb: Float[Array, "b t n n"]) -> Float[Array, "b t n d"]:
        """``hc_post`` (the fused kernel when selected)."""
        with jax.named_scope("mhc"):
            return per_request(functools.partial(hc_post, fused=self.num.mhc_fused()), mhc_mesh(self), f, x, post, comb)

    def attn_in(self, x: Float[Array, "b t n d"]):
        """Collapsed, normalised attention input and the mHC weights to expand its output."""
        kw = self._unit_kw(self.attn_norm)

        def pre(fn, base, scale, w, x):
            return hc_pre_norm(x, fn, base, scale, w, **kw)

        with jax.named_scope("mhc"):
            return per_request(pre, mhc_mesh(self), x, replicated=(
                self.hc_attn_fn[...], self.hc_attn_base[...], self.hc_attn_scale[...], self.attn_norm.weight[...]))

    def _post_pre(self, unit: str, f: Float[Array, "b t d"] | Partials, x: Float[Array, "b t n d"],
                  post: Float[Array, "b t n"], comb: Float[Array, "b t n n"]):
        """A sub-block's output f expanded into the streams (hc_post), then the collapsed,
        normalised input of this block's ``unit`` ("attn" or "ffn"): (X', input, post', comb').
        f may be a linear's partial sums (``gemv.Partials``) or a one-token MoE's terms
        (``gemv.ExpertRows``)."""
        norm = self.attn_norm if unit == "attn" else self.ffn_norm
        kw = self._unit_kw(norm)
        mesh = mhc_mesh(self)
        if mesh is not None:  # per request on a mesh: f as one array
            f = total(f, x.dtype)

        def post_pre(fn, base, scale, w, f, x, post, comb):
            return hc_post_pre_norm(f, x, post, comb, fn, base, scale, w, **kw)

        params = (getattr(self, f"hc_{unit}_fn"), getattr(self, f"hc_{unit}_base"), getattr(self, f"hc_{unit}_scale"))
        with jax.named_scope("mhc"):
            return per_request(post_pre, mesh, f, x, post, comb,
                               replicated=(*(p[...] for p in params), norm.weight[...]))

    def ffn_in(self, f: Float[Array, "b t d"] | Partials, x: Float[Array, "b t n d"], post: Float[Array, "b t n"],
               comb: Float[Array, "b t n n"]):
        """The attention output f expanded into the streams (hc_post), and the MoE's collapsed,
        normalised input: (X', input, post, comb)."""
        return self._post_pre("ffn", f, x, post, comb)

    def ffn_out(self, x: Float[Array, "b t n d"], y: Float[Array, "b t d"], post: Float[Array, "b t n"],
                comb: Float[Array, "b t n n"], ids: Int[Array, "b t"]) -> Float[Array, "b t n d"]:
        """The MoE on its input y, expanded into the streams X (hc_post)."""
        with jax.named_scope("moe"):
            f = self.ffn(y, ids)
        return self.post(f, x, post, comb)

    def unexpanded(self, x: Float[Array, "b t n d"], chunk: Chunk, cache: LayerCache, pending: Pending | None = None
                   ) -> tuple[Float[Array, "b t n d"], Pending, LayerCache]:
        """The block with its last hc_post left to the caller: (the streams before it, the MoE's
        output with its post and comb, the cache). ``pending``: the previous block's, likewise
        left (x then the streams before it): expanded in this block's first mHC launch
        (``hc_post_pre_norm``) instead of a launch of its own."""
        if pending is None:
            y, post, comb = self.attn_in(x)
        else:
            x, y, post, comb = self._post_pre("attn", pending.f, x, pending.post, pending.comb)
        with jax.named_scope("attention"):
            f, cache = self.attn(y, chunk, cache)
        x, y, post, comb = self.ffn_in(f, x, post, comb)
        with jax.named_scope("moe"):
            f = self.ffn(y, chunk.ids)
        return x, Pending(f, post, comb), cache

    def expand(self, x: Float[Array, "b t n d"], pending: Pending) -> Float[Array, "b t n d"]:
        """The streams after the hc_post ``unexpanded`` left."""
        return self.post(pending.f, x, pending.post, pending.comb)

    def __call__(self, x: Float[Array, "b t n d"], chunk: Chunk, cache: LayerCache
                 ) -> tuple[Float[Array, "b t n d"], LayerCache]:
        x, pending, cache = self.unexpanded(x, chunk, cache)
        return self.expand(x, pending), cache
