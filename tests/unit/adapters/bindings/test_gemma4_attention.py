"""Gemma4's full-attention layer, from transformers' own model definition, against every graphbuf route.

The same q/k/v at the kernel boundary (after projection and the q/k/v norms of transformers'
``Gemma4TextAttention`` of a global layer; RoPE is a rotation applied before that boundary) go into
``eager_attention_forward`` of ``transformers.models.gemma4.modeling_gemma4`` with that module's own
``scaling`` and into each graphbuf route: ``large_head`` dense, paged and blockwise decode and verify,
``LargeHeadBinding`` built with the shipped spec's task options (what ``graphbuf drill`` runs), and the routed
``forward_impl`` of the vllm-ascend patch. Geometry
per rank at TP=2: 16 query heads, 2 KV heads, head_dim 512, block size 128; decode (q_len 1) and MTP verify
(q_len 4); contexts that are and are not block multiples, one past the sliding window (global layers have
none). float32: max abs error ≤ 1e-4; bf16: no farther from a float64 reference than transformers' own bf16.

transformers is installed by the ``model`` extra (``.ci/run``); it is imported only by these tests.
"""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from graphbuf.adapters.vllm_ascend.bindings import large_head
from graphbuf.adapters.vllm_ascend.bindings.attention_tasks import LargeHeadBinding
from graphbuf.adapters.vllm_ascend.glue import routing
from graphbuf.drill.session import drill_plan
from graphbuf.graphs.runner import Step

modeling = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
configuration = pytest.importorskip("transformers.models.gemma4.configuration_gemma4")

NQ, NKV, D, BLOCK = 16, 2, 512, 128
CONTEXTS = {
    "block multiples": [256, 128, 512],
    "not block multiples": [301, 130, 1100],  # 1100 > the sliding window (1024): a global layer has none
}
TABLE: list[dict[str, object]] = []


@pytest.fixture(scope="module")
def attention() -> torch.nn.Module:
    """transformers' Gemma4 attention module of a global (full) layer at the 31B's per-rank head geometry."""
    config = configuration.Gemma4TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=NQ,
        num_key_value_heads=4, head_dim=32, num_global_key_value_heads=NKV, global_head_dim=D,
        attention_k_eq_v=True, layer_types=["sliding_attention", "full_attention"], sliding_window=1024,
    )  # fmt: skip
    config._attn_implementation = "eager"
    module = modeling.Gemma4TextAttention(config, 1).eval()
    assert (module.head_dim, module.num_key_value_groups) == (D, NQ // NKV)
    assert module.sliding_window is None and module.use_alternative_attention and module.v_proj is None
    with torch.no_grad():  # learned q/k norm weights, not the identity
        gen = torch.Generator().manual_seed(7)
        for norm in (module.q_norm, module.k_norm):
            norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=gen))
    return module


def _boundary(module: torch.nn.Module, lens: list[int], q_len: int, seed: int) -> dict[str, object]:
    """q/k/v as the kernel sees them (float64): q = q_norm(q_proj x), k = k_norm(k_proj x),
    v = v_norm(k_proj x) (``attention_k_eq_v``: V comes from the K projection), paged into a KV cache
    through a block table."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens)
    with torch.no_grad():
        q = module.q_norm(torch.randn(batch * q_len, NQ, D, generator=gen, dtype=torch.float64))
        k_proj = [torch.randn(n, NKV, D, generator=gen, dtype=torch.float64) for n in lens]
        keys = [module.k_norm(x) for x in k_proj]
        values = [module.v_norm(x) for x in k_proj]
    width = max(-(-n // BLOCK) for n in lens)
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 3
    cache = torch.zeros(2, num_blocks, BLOCK, NKV, D, dtype=torch.float64)  # vLLM's layout: [0] K, [1] V
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered block ids, block 0 never used
    table = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lens):
        for j in range(-(-n // BLOCK)):
            block = int(perm[used])
            used += 1
            table[r, j] = block
            rows = slice(j * BLOCK, min(n, (j + 1) * BLOCK))
            cache[0, block, : rows.stop - rows.start] = keys[r][rows]
            cache[1, block, : rows.stop - rows.start] = values[r][rows]
    return {"q": q, "keys": keys, "values": values, "cache": cache, "table": table,
            "lens": torch.tensor(lens, dtype=torch.int32)}  # fmt: skip


def _transformers(
    module: torch.nn.Module, data: dict[str, object], q_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """transformers' ``eager_attention_forward`` with the module's own scaling, request by request, with the
    bottom-right causal mask of decode/verify; ``[B * q_len, Nq, D]``."""
    outs = []
    q = data["q"].view(-1, q_len, NQ, D)  # type: ignore[union-attr]
    for r, (k, v) in enumerate(zip(data["keys"], data["values"])):  # type: ignore[arg-type]
        n = k.shape[0]
        query = q[r].transpose(0, 1).unsqueeze(0).to(dtype)  # [1, Nq, q_len, D]
        key, value = (t.transpose(0, 1).unsqueeze(0).to(dtype) for t in (k, v))  # [1, Nkv, n, D]
        hidden = torch.arange(n).view(1, -1) > (n - q_len + torch.arange(q_len)).view(-1, 1)
        mask = torch.zeros(1, 1, q_len, n, dtype=dtype).masked_fill(hidden, float("-inf"))
        out, _ = modeling.eager_attention_forward(module, query, key, value, mask, scaling=module.scaling)
        outs.append(out[0])  # [q_len, Nq, D]
    return torch.cat(outs).to(torch.float64)


def _routes(q_len: int, spec_scale: float) -> dict[str, Callable[..., torch.Tensor]]:
    """Every graphbuf route for this query length: ``fn(q, key_cache, value_cache, table, lens)``."""

    def binding(**modes: object) -> Callable[..., torch.Tensor]:
        def run(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor, lens: torch.Tensor):
            bind = LargeHeadBinding(
                group="full",
                q_len=q_len,
                scale=spec_scale,
                **modes,  # type: ignore[arg-type]
            )
            out = torch.zeros_like(q)
            host = bind.host_args(bt.shape[0], lens.tolist()) if q_len == 1 else {}
            step = Step(q.shape[0], {"block_table.full": bt, "seq_lens": lens}, None, host, bt.shape[0])
            return (bind.decode if q_len == 1 else bind.verify)(step, q, kc, vc, out)

        return run

    if q_len == 1:
        return {
            "dense": lambda q, kc, vc, bt, lens: large_head.decode_attention(q, kc, vc, bt, lens, spec_scale),
            "paged": lambda q, kc, vc, bt, lens: large_head.decode_attention(
                q, kc, vc, bt, lens, spec_scale, seq_lens_host=lens.tolist()
            ),
            "blockwise": lambda q, kc, vc, bt, lens: large_head.decode_attention(
                q, kc, vc, bt, lens, spec_scale, chunk_blocks=2
            ),
            "binding paged (drill)": binding(decode_mode="paged"),
            "binding dense (drill)": binding(decode_mode="dense"),
            "routed forward_impl": _routed(1, spec_scale),
        }
    return {
        "dense": lambda q, kc, vc, bt, lens: large_head.verify_attention(
            q, kc, vc, bt, lens, q_len, spec_scale
        ),
        "blockwise": lambda q, kc, vc, bt, lens: large_head.verify_attention_blockwise(
            q, kc, vc, bt, lens, q_len, spec_scale, 2
        ),
        "binding blockwise (drill)": binding(verify_mode="blockwise", chunk_blocks=2),
        "binding dense (drill)": binding(verify_mode="dense"),
        "routed forward_impl": _routed(q_len, spec_scale),
    }


def _routed(q_len: int, impl_scale: float) -> Callable[..., torch.Tensor]:
    """The patched ``forward_impl`` (``routing.forward``) under a FULL graph forward context, the layer's
    ``impl.scale`` being what vLLM's Gemma4 gives its attention layer (``self.scaling``)."""

    def run(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor, lens: torch.Tensor):
        impl = types.SimpleNamespace(
            head_size=D, scale=impl_scale, sliding_window=None, sinks=None, alibi_slopes=None,
            attn_type="decoder", key_cache=kc, value_cache=vc,
        )  # fmt: skip
        route = routing.Route(
            q_len=q_len, block_table=bt, seq_lens=lens, size=q.shape[0], num_reqs=bt.shape[0]
        )
        metadata = types.SimpleNamespace(attn_state="DecodeOnly" if q_len == 1 else "SpecDecoding")
        setattr(metadata, routing.ROUTE_ATTR, route)

        def upstream(*args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("the routed batch fell back to vllm-ascend's path")

        out = torch.zeros_like(q)
        return routing.forward(upstream, impl, q, None, None, None, metadata, out)

    return run


@pytest.fixture(autouse=True)
def full_graph_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's forward context saying the step replays a FULL graph (what routes a batch to graphbuf), and the
    rest of the upstream surface the routed forward reads (adapters/vllm_ascend/glue/upstream.py):
    vllm-ascend's forward context (replaying, not capturing) and its attention module's compute fence."""
    context = types.SimpleNamespace(cudagraph_runtime_mode=types.SimpleNamespace(name="FULL"))
    module = types.ModuleType("vllm.forward_context")
    module.is_forward_context_available = lambda: True  # type: ignore[attr-defined]
    module.get_forward_context = lambda: context  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.forward_context", module)
    extra = types.ModuleType("vllm_ascend.ascend_forward_context")
    extra._EXTRA_CTX = types.SimpleNamespace(capturing=False)  # type: ignore[attr-defined]
    attention = types.ModuleType("vllm_ascend.attention.attention_v1")
    attention.record_attention_compute_start = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm_ascend", types.ModuleType("vllm_ascend"))
    monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_forward_context", extra)
    monkeypatch.setitem(sys.modules, "vllm_ascend.attention.attention_v1", attention)


def test_the_shipped_spec_states_gemma4_s_scale_and_geometry(attention: torch.nn.Module) -> None:
    tasks = drill_plan("gemma4-31b-it-mtp").tasks
    assert [t.name for t in tasks] == ["decode", "verify"]
    for task in tasks:
        assert task.scale == attention.scaling == 1.0  # not head_dim ** -0.5
        assert (task.num_heads, task.num_kv_heads, task.head_dim) == (NQ, NKV, D)


@pytest.mark.parametrize("q_len", [1, 4], ids=["decode", "verify"])
@pytest.mark.parametrize("contexts", list(CONTEXTS), ids=list(CONTEXTS))
def test_every_route_matches_transformers_gemma4_attention(
    attention: torch.nn.Module, q_len: int, contexts: str
) -> None:
    lens = CONTEXTS[contexts]
    data = _boundary(attention, lens, q_len, seed=q_len * 10 + len(contexts))
    reference = _transformers(attention, data, q_len, torch.float64)
    tf_bf16 = (_transformers(attention, data, q_len, torch.bfloat16) - reference).abs().max().item()
    cache, table, seq_lens = data["cache"], data["table"], data["lens"]
    spec_scale = drill_plan("gemma4-31b-it-mtp").tasks[0].scale
    case = f"{'decode' if q_len == 1 else 'verify'} q_len {q_len}, contexts {lens}"
    failures = []
    for name, route in _routes(q_len, spec_scale).items():
        errors = {}
        for dtype in (torch.float32, torch.bfloat16):
            kv = cache.to(dtype)  # type: ignore[union-attr]
            got = route(data["q"].to(dtype), kv[0], kv[1], table, seq_lens)  # type: ignore[union-attr]
            errors[dtype] = (got.to(torch.float64) - reference).abs().max().item()
        TABLE.append({"route": name, "case": case, "float32": errors[torch.float32],
                      "bfloat16": errors[torch.bfloat16], "transformers_bfloat16": tf_bf16})  # fmt: skip
        if not errors[torch.float32] <= 1e-4:
            failures.append(f"{name}: float32 max abs err {errors[torch.float32]:.3g} > 1e-4")
        if not errors[torch.bfloat16] <= tf_bf16:
            failures.append(
                f"{name}: bf16 max abs err {errors[torch.bfloat16]:.3g} > transformers' {tf_bf16:.3g}"
            )
    assert not failures, failures


def test_the_old_scale_would_fail(attention: torch.nn.Module) -> None:
    """The check has teeth: 1/sqrt(head_dim), the scale the drill used before, is far from Gemma4's."""
    data = _boundary(attention, CONTEXTS["not block multiples"], 1, seed=3)
    reference = _transformers(attention, data, 1, torch.float64)
    kv = data["cache"].to(torch.float32)  # type: ignore[union-attr]
    q, table, lens = data["q"].float(), data["table"], data["lens"]  # type: ignore[union-attr]
    got = large_head.decode_attention(q, kv[0], kv[1], table, lens, D**-0.5)  # type: ignore[arg-type]
    assert (got.double() - reference).abs().max().item() > 0.1


def teardown_module() -> None:
    """Print the route × case × max error table (and write it where GRAPHBUF_ATTENTION_TABLE says)."""
    if not TABLE:
        return
    lines = [f"{'route':<28} {'case':<50} {'f32 err':>9} {'bf16 err':>9} {'hf bf16':>9}"]
    lines += [
        f"{r['route']:<28} {r['case']:<50} {r['float32']:>9.2e} {r['bfloat16']:>9.2e} "
        f"{r['transformers_bfloat16']:>9.2e}"
        for r in TABLE
    ]
    print("\n" + "\n".join(lines))
    target = os.environ.get("GRAPHBUF_ATTENTION_TABLE")
    if target:
        Path(target).write_text(json.dumps(TABLE, indent=1) + "\n", encoding="utf-8")
