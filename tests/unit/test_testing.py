"""``graphbuf.testing``: batches every refresh accepts, labelled batches it must reject, valid specs, the
adapter's relations reached through the task factory registry, the README example, the profiles, and
Hypothesis staying optional."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import graphbuf
from graphbuf.adapters.vllm_ascend.spec.strategies import vllm_decode_batch
from graphbuf.spec.factories import declare_options, registered_factories, task_strategy
from graphbuf.testing import (
    PROFILES,
    Batch,
    Rejected,
    batches,
    examples,
    paged_kv,
    specs,
    task_relations,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = graphbuf.StaticBuffers("gemma4-31b-it-mtp", overrides={"num_blocks": 64, "max_model_len": 512})


@pytest.fixture(scope="module")
def small() -> graphbuf.StaticBuffers:
    from conftest import SMALL_SPEC

    return graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(SMALL_SPEC))


def _host(src: Any) -> np.ndarray:
    return np.asarray(src.float() if hasattr(src, "float") and not isinstance(src, np.ndarray) else src)


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batches_refresh_and_pad_as_the_spec_says(small: graphbuf.StaticBuffers, data: st.DataObject) -> None:
    batch = data.draw(batches(small))
    assert isinstance(batch, Batch) and batch.size in small.capture_sizes
    size, sources = batch  # a (size, sources) pair
    assert 1 <= batch.num_reqs <= size // small.plan.tokens_per_request
    assert small.refresh(size, sources) == batch.num_reqs
    views = small.view(size)
    for name, src in sources.items():
        b, host = small.plan[name], _host(src)
        if b.min is not None:
            assert host.size == 0 or host.min() >= b.min
        if b.max is not None:
            assert host.size == 0 or host.max() <= b.max
        view = views[name].numpy()
        live = view[: host.shape[0]]
        if host.ndim == 2:
            assert host.shape[1] <= view.shape[1]  # within the captured allocation
            np.testing.assert_array_equal(live[:, : host.shape[1]], host)
            if not b.keep:
                assert (live[:, host.shape[1] :] == b.pad).all()  # stale columns hold the pad
        else:
            np.testing.assert_array_equal(live, host)
        if b.pad != "repeat_last" and not b.keep:
            assert (view[host.shape[0] :] == b.pad).all()


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rejected_batches_raise_exactly_their_label(
    small: graphbuf.StaticBuffers, data: st.DataObject
) -> None:
    bad = data.draw(batches(small, rejected=True))
    assert isinstance(bad, Rejected)
    before = small.slab.numpy().tobytes()
    with pytest.raises(graphbuf.RefreshError) as info:
        small.refresh(*bad)
    assert type(info.value) is bad.error, (bad.reason, info.value)
    assert small.slab.numpy().tobytes() == before  # rejected: no byte changed


ALL_KEEP = graphbuf.StaticBuffers(
    graphbuf.GraphSpec.model_validate({
        "version": 1, "name": "all-keep", "constants": {"max_num_seqs": 4},
        "capture": {"tokens_per_request": 1, "sizes": [2, 4]},
        "buffers": {
            "lens": {"dtype": "int32", "rows": "requests", "pad": 0, "min": 0, "max": 9, "keep": True},
            "scale": {"dtype": "float32", "rows": 1, "pad": 0, "keep": True},
        },
    })
)  # fmt: skip


@settings(max_examples=examples(40))
@given(batch=batches(ALL_KEEP), bad=batches(ALL_KEEP, rejected=True))
def test_every_buffer_keep_still_gives_acceptable_and_rejectable_batches(batch: Batch, bad: Rejected) -> None:
    """Left-out keep buffers never take away every source, nor the last one carrying the live count."""
    assert "lens" in batch.sources
    assert ALL_KEEP.refresh(*batch) == batch.num_reqs  # no num_reqs= needed
    before = ALL_KEEP.slab.numpy().tobytes()
    with pytest.raises(graphbuf.RefreshError) as info:
        ALL_KEEP.refresh(*bad)
    assert type(info.value) is bad.error, (bad.reason, info.value)
    assert ALL_KEEP.slab.numpy().tobytes() == before


def test_every_kind_of_rejection_is_drawn(small: graphbuf.StaticBuffers) -> None:
    for error in (graphbuf.RowsError, graphbuf.WidthError, graphbuf.RefreshError):
        found = find(batches(small, rejected=True), lambda b, e=error: b.error is e, settings=settings(
            database=None, max_examples=500))  # fmt: skip
        assert found.error is error and found.reason


def test_size_restricts_the_capture_size(small: graphbuf.StaticBuffers) -> None:
    smallest = find(batches(small, size=4), lambda b: True, settings=settings(database=None))
    assert smallest.size == 4 and smallest.num_reqs == 1  # shrinks to one request
    largest = find(batches(small, size=4), lambda b: b.num_reqs == 2, settings=settings(database=None))
    assert largest.size == 4
    with pytest.raises(ValueError, match=r"size=5.*sizes: 2, 4, 8"):
        batches(small, size=5)


@settings(max_examples=examples(40))
@given(batches(SHIPPED))
def test_the_adapters_relation_holds_on_the_shipped_spec(batch: Batch) -> None:
    """The relations a spec cannot state come from its tasks' registered strategy (the adapter's)."""
    p, src, live = SHIPPED.plan, batch.sources, batch.num_reqs
    lens, tpr, bs = np.asarray(src["seq_lens"]), p.tokens_per_request, int(p.constants["block_size"])
    assert (lens >= tpr).all()
    np.testing.assert_array_equal(src["query_start_loc"], np.arange(live + 1) * tpr)
    for group in ("sliding", "full"):
        table = np.asarray(src[f"block_table.{group}"])
        assert table.shape[1] >= -(-int(lens.max()) // bs)  # wide enough for cdiv(seq_len, block_size)
        for r in range(live):
            n = -(-int(lens[r]) // bs)
            assert len(set(table[r, :n].tolist())) == n  # a request never holds a block twice
            pos = np.arange(lens[r] - tpr, lens[r])
            slots = table[r, pos // bs].astype(np.int64) * bs + pos % bs
            np.testing.assert_array_equal(src[f"slot_mapping.{group}"][r * tpr : (r + 1) * tpr], slots)
    SHIPPED.refresh(*batch)


def test_relations_come_through_the_factory_registry() -> None:
    registry = registered_factories()
    for factory in ("graphbuf.adapters.vllm_ascend.bindings.attention_tasks:decode_task",
                    "graphbuf.adapters.vllm_ascend.bindings.attention_tasks:verify_task"):  # fmt: skip
        assert registry[factory].strategy == "graphbuf.adapters.vllm_ascend.spec.strategies:vllm_decode_batch"
        assert task_strategy(factory) is vllm_decode_batch
    assert task_relations(SHIPPED.plan.spec) == (vllm_decode_batch,)  # decode and verify share it: once
    assert task_strategy("graphbuf.drill.session:PagedDecodeAttention") is paged_kv
    spec = graphbuf.GraphSpec.model_validate({**SHIPPED.plan.spec.model_dump(), "tasks": []})
    assert task_relations(spec) == ()


def test_an_allowed_factory_declares_its_relation() -> None:
    assert task_strategy("user_factories:widget_task", ["user_factories"]) is None

    @declare_options(graphbuf.GraphSpec, strategy="graphbuf.testing:paged_kv")
    def factory(name: str, **options: Any) -> None:
        return None

    assert factory.graphbuf_strategy == "graphbuf.testing:paged_kv"
    with pytest.raises(ValueError, match="neither registered"):
        task_strategy("user_factories:widget_task")  # not allowed: refused before any import


def test_core_graphbuf_names_no_engine() -> None:
    """The vLLM batch names live in the adapter; core graphbuf (drill included) derives batches from the
    spec's rules and the relations its tasks register. The whole-model drill is exempt: like the adapter, it
    builds one engine's step (a Gemma4 forward over vLLM-style paged metadata) on top of the core."""
    for path in (ROOT / "graphbuf").rglob("*.py"):
        if path.relative_to(ROOT).as_posix().startswith("graphbuf/drill/model/"):
            continue
        text = path.read_text(encoding="utf-8")
        for name in ("query_start_loc", "slot_mapping", "adapters.vllm_ascend", "import vllm"):
            assert name not in text, f"{path.relative_to(ROOT)} names {name}"


@settings(max_examples=examples(50))
@given(specs())
def test_specs_are_valid_documents_that_plan(doc: dict[str, Any]) -> None:
    spec = graphbuf.GraphSpec.model_validate(doc)
    p = graphbuf.plan(spec)
    assert p.capture_sizes and p.buffers


def test_specs_shrink_toward_small_ones() -> None:
    doc = find(specs(), lambda d: True, settings=settings(database=None))
    assert len(doc["buffers"]) == 1 and doc["capture"]["tokens_per_request"] == 1
    assert len(doc["capture"]["sizes"]) == 1 and len(doc["groups"]) == 1


def _readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- tested by tests/unit/test_testing.py -->\n```python\n(.*?)```", text, re.S)
    assert match, "README: the property-test example block is missing"
    return match.group(1)


def test_readme_example_runs() -> None:
    code = _readme_example()
    assert len(code.strip().splitlines()) <= 10
    namespace: dict[str, Any] = {}
    exec(compile(code, "<README.md example>", "exec"), namespace)
    tests = [v for k, v in namespace.items() if k.startswith("test_") and isinstance(v, Callable)]
    assert len(tests) == 1
    tests[0]()  # runs the Hypothesis property test under the loaded profile


def test_profiles() -> None:
    register = PROFILES
    assert register["ci"]["derandomize"] is True and register["deep"]["derandomize"] is False
    assert register["deep"]["max_examples"] >= 10 * register["ci"]["max_examples"]
    assert settings.get_profile("deep").max_examples == register["deep"]["max_examples"]
    factor = settings.default.max_examples // register["ci"]["max_examples"]
    assert examples(30) == 30 * factor


def test_deep_profile_runs_ten_times_the_examples(tmp_path: Path) -> None:
    (tmp_path / "test_count.py").write_text(
        textwrap.dedent("""
        from hypothesis import given, settings, strategies as st
        from graphbuf.testing import examples, register_profiles
        CALLS = []

        @settings(max_examples=examples(5))
        @given(st.integers())
        def test_count(x):
            CALLS.append(x)

        def test_report():
            print("CALLS", len(CALLS), settings.default.derandomize)
    """)
    )
    (tmp_path / "conftest.py").write_text(
        "from graphbuf.testing import register_profiles\nregister_profiles()\n"
    )
    out = {}
    for profile in ("ci", "deep"):
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
             f"--hypothesis-profile={profile}", str(tmp_path / "test_count.py")],
            capture_output=True, text=True, cwd=tmp_path, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        out[profile] = re.search(r"CALLS (\d+) (\w+)", run.stdout).groups()  # type: ignore[union-attr]
    assert out["ci"] == ("5", "True") and out["deep"] == ("50", "False")


BLOCK_HYPOTHESIS = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "hypothesis" or name.startswith("hypothesis."):
            raise ModuleNotFoundError("No module named 'hypothesis'", name="hypothesis")
sys.meta_path.insert(0, Block())
"""


def test_graphbuf_works_without_hypothesis() -> None:
    code = BLOCK_HYPOTHESIS + textwrap.dedent("""
        import graphbuf
        bufs = graphbuf.StaticBuffers("gemma4-31b-it-mtp", overrides={"num_blocks": 8})
        assert bufs.plan.capture_sizes
        try:
            import graphbuf.testing
        except ImportError as exc:
            print("ERROR", exc)
        from graphbuf.cli import main
        print("EXIT", main(["drill", "gemma4-31b-it-mtp", "--replays", "1"]))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "ERROR graphbuf.testing needs Hypothesis" in run.stdout
    assert "pip install -c constraints.txt -e ." in run.stdout and "graphbuf[test]" not in run.stdout
    assert "EXIT 2" in run.stdout and "usage error: missing dependency: the module 'hypothesis'" in run.stderr


def _hostile_calls(sb: graphbuf.StaticBuffers) -> dict[str, Callable[[], Any]]:
    from hypothesis import strategies as hs

    from graphbuf.testing import as_source, bounds, sample, sources

    p = sb.plan
    return {
        "batches(None)": lambda: batches(None),
        "batches(size=4.0)": lambda: batches(sb, size=4.0),
        "batches(size=True)": lambda: batches(sb, size=True),
        "batches(size=5)": lambda: batches(sb, size=5),
        "batches(relations=[1])": lambda: batches(sb, relations=[1]),
        "batches(relations=5)": lambda: batches(sb, relations=5),
        "batches(rejected='x')": lambda: batches(sb, rejected="x"),
        "sources(None, 1)": lambda: sources(None, 1),
        "sources(live=-1)": lambda: sources(sb, -1),
        "sources(live=2.5)": lambda: sources(sb, 2.5),
        "sources(live=10**30)": lambda: sources(sb, 10**30),
        "sources(live=2**20 + 1)": lambda: sources(sb, 2**20 + 1),
        "sources(size=4.0)": lambda: sources(sb, 1, size=4.0),
        "sources(size=2, live=4)": lambda: sources(sb, 4, size=2),
        "sample(None)": lambda: sample(None),
        "sample(count=-1)": lambda: sample(hs.just(1), count=-1),
        "sample(count=2.5)": lambda: sample(hs.just(1), count=2.5),
        "examples(-5)": lambda: examples(-5),
        "examples('x')": lambda: examples("x"),
        "bounds(None)": lambda: bounds(None),
        "as_source(None, [1])": lambda: as_source(None, [1]),
        "as_source(b, 'xyz')": lambda: as_source(p.buffers[0], "xyz"),
        "paged_kv(None, 4, 1)": lambda: paged_kv(None, 4, 1),
        "paged_kv(p, 4, -1)": lambda: paged_kv(p, 4, -1),
        "paged_kv(p, 4.0, 1)": lambda: paged_kv(p, 4.0, 1),
        "task_relations(None)": lambda: task_relations(None),
    }


def test_argument_errors_are_typed_usage_errors(small: graphbuf.StaticBuffers) -> None:
    """Issue 21 §2: every bad argument to graphbuf.testing is a UsageError naming the call and argument
    (was: bare TypeError, ValueError, AttributeError or Hypothesis InvalidArgument; batches(size=4.0) drew
    batches of size 4.0), raised when the strategy is built, before anything is drawn."""
    from graphbuf.errors import UsageError

    for name, call in _hostile_calls(small).items():
        with pytest.raises(UsageError) as info:
            call()
        msg = str(info.value)
        assert msg.startswith(name.split("(")[0] + "("), (name, msg)
        assert len(msg) < 200, (name, msg)


def test_a_batch_says_when_its_refresh_needs_num_reqs() -> None:
    """Issue 21 §4: with no buffer whose rows carry the live count, a Batch holds num_reqs in ``kwargs``
    and ``refresh(*batch, **batch.kwargs)`` accepts it; otherwise ``kwargs`` is empty."""
    from graphbuf.testing import sample

    doc = {
        "version": 1,
        "name": "fixed",
        "capture": {"sizes": [2, 4]},
        "buffers": {
            "scale": {"dtype": "float32", "rows": 2},
            "flags": {"dtype": "int8", "rows": "2", "keep": True},
        },
    }
    sb = graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(doc))
    for batch in sample(batches(sb), seed=3, count=10):
        assert batch.kwargs == {"num_reqs": batch.num_reqs} and batch.needs_num_reqs
        with pytest.raises(graphbuf.RefreshError, match="no source determines the live request count"):
            sb.refresh(*batch)
        assert sb.refresh(*batch, **batch.kwargs) == batch.num_reqs
    for bad in sample(batches(sb, rejected=True), seed=3, count=10):
        with pytest.raises(bad.error) as info:
            sb.refresh(*bad, **bad.kwargs)
        assert type(info.value) is bad.error


def test_a_failing_example_prints_the_batch_s_size_live_requests_and_sources(tmp_path: Path) -> None:
    """Issue 33 §4: Hypothesis prints a failing Batch by its values (it printed ``Batch(s, {...}, live,
    needs)``, the names in the expression that built it)."""
    (tmp_path / "test_fails.py").write_text(
        textwrap.dedent("""
        from hypothesis import given, settings
        from graphbuf import StaticBuffers
        from graphbuf.testing import batches

        buffers = StaticBuffers("gemma4-31b-it-mtp", overrides={"num_blocks": 64, "max_model_len": 512})

        @settings(max_examples=50, database=None, derandomize=True)
        @given(batches(buffers))
        def test_fails(batch):
            assert batch.num_reqs < 2
    """)
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_fails.py")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    shown = re.search(r"batch=(Batch\(.*\)),\n", run.stdout)
    assert shown, run.stdout[-3000:]
    text = shown.group(1)
    assert re.match(r"Batch\(size=\d+, num_reqs=2, sources=\{'block_table.sliding': \[\[", text), text
    assert "'seq_lens': [" in text and "(int32)" in text and "Batch(s, " not in run.stdout
    batch = Batch(4, {"lens": np.array([3, 5], dtype=np.int32), "ids": [1, 2]}, 2)
    assert repr(batch) == "Batch(size=4, num_reqs=2, sources={'lens': [3, 5] (int32), 'ids': [1, 2]})"
    assert repr(Rejected(4, {"lens": [9]}, 1, graphbuf.RowsError, "too many rows")) == (
        "Rejected(size=4, num_reqs=1, error=RowsError, reason='too many rows', sources={'lens': [9]})"
    )
