"""Issue 21 §3 and issue 19 §5: ``graphbuf sizes --write`` keeps every byte outside the ``sizes`` value.

A corpus of layouts (flow, block, indentless, commented, ranges, aliased ``sizes: *S``, anchored, tagged
``!!seq``, tabs), each under LF, CRLF and CR-only line endings, with and without a UTF-8 BOM: the file after
``--write`` is exactly the expected bytes. Layouts the edit cannot make alone (an anchor used elsewhere, a
merge key, a foreign tag) are refused with the reason, exit 2, the file byte-identical; so is a write that
fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphbuf.cli import main
from graphbuf.errors import SpecError
from graphbuf.planning.sizes import write_sizes
from graphbuf.spec.models import parse_yaml
from graphbuf.testing import examples

HEAD = "version: 1\nname: rt\nconstants:\n  max_num_seqs: 4\ncapture:\n  tokens_per_request: 2\n"
TAIL = "buffers:\n  a: {dtype: int32, rows: tokens}  # one buffer\n"
# --max-waste 0 on this envelope (1..4 requests, 2 tokens each) proposes exactly these:
NEW = "[2, 4, 6, 8]"
BLOCK_NEW = "- 2\n{i}- 4\n{i}- 6\n{i}- 8"

# layout name → (the capture lines after tokens_per_request, what --write leaves there).
LAYOUTS: dict[str, tuple[str, str]] = {
    "flow": (
        "  sizes: [2]\n  max_requests: max_num_seqs\n",
        f"  sizes: {NEW}\n  max_requests: max_num_seqs\n",
    ),
    "flow-commented": (
        "  # the graphs\n  sizes: [2]   # one graph\n  max_requests: max_num_seqs\n",
        f"  # the graphs\n  sizes: {NEW}   # one graph\n  max_requests: max_num_seqs\n",
    ),
    "flow-multiline-comment-inside": (
        "  sizes: [2,   # small\n    4]\n  max_requests: max_num_seqs\n",
        "  sizes: [\n    # small\n    2, 4, 6, 8]\n  max_requests: max_num_seqs\n",
    ),
    "flow-in-flow": (
        "  max_requests: max_num_seqs\n  sizes: {start: 2, stop: 4, step: 2}\n",
        f"  max_requests: max_num_seqs\n  sizes: {NEW}\n",
    ),
    "block": (
        "  sizes:\n    - 2\n    - 4\n  max_requests: max_num_seqs\n",
        "  sizes:\n    " + BLOCK_NEW.format(i="    ") + "\n  max_requests: max_num_seqs\n",
    ),
    "block-indentless-commented": (
        "  sizes:   # graphs\n  - 2   # one\n  # between\n  - 4 # two\n  # after\n"
        "  max_requests: max_num_seqs\n",
        "  sizes:   # graphs\n  # one\n  # between\n  # two\n  "
        + BLOCK_NEW.format(i="  ")
        + "\n  # after\n  max_requests: max_num_seqs\n",
    ),
    "block-range": (
        "  sizes:\n    start: 2   # first\n    stop: 4\n    step: 2\n  max_requests: max_num_seqs\n",
        "  sizes:\n    # first\n    " + BLOCK_NEW.format(i="    ") + "\n  max_requests: max_num_seqs\n",
    ),
    "aliased": (
        "  sizes: *S\n  max_requests: max_num_seqs\n",
        f"  sizes: {NEW}\n  max_requests: max_num_seqs\n",
    ),
    "aliased-range": (
        "  sizes: *R   # from meta\n  max_requests: max_num_seqs\n",
        f"  sizes: {NEW}   # from meta\n  max_requests: max_num_seqs\n",
    ),
    "anchored-flow": (
        "  sizes: &mine [2]\n  max_requests: max_num_seqs\n",
        f"  sizes: &mine {NEW}\n  max_requests: max_num_seqs\n",
    ),
    "anchored-tagged-block": (
        "  sizes: &mine !!seq\n    - 2\n  max_requests: max_num_seqs\n",
        "  sizes: &mine !!seq\n    " + BLOCK_NEW.format(i="    ") + "\n  max_requests: max_num_seqs\n",
    ),
    "tagged-flow": (
        "  sizes: !!seq [2]\n  max_requests: max_num_seqs\n",
        f"  sizes: !!seq {NEW}\n  max_requests: max_num_seqs\n",
    ),
    "tagged-block-indentless": (
        "  sizes: !!seq\n  - 2\n  max_requests: max_num_seqs\n",
        "  sizes: !!seq\n  " + BLOCK_NEW.format(i="  ") + "\n  max_requests: max_num_seqs\n",
    ),
    "tabs": (
        "  sizes:\t[2]\t# tab\n  max_requests:\tmax_num_seqs\n",
        f"  sizes:\t{NEW}\t# tab\n  max_requests:\tmax_num_seqs\n",
    ),
    "block-tab-comment": (
        "  sizes:\n  - 2\t# tabbed\n  max_requests: max_num_seqs\n",
        "  sizes:\n  # tabbed\n  " + BLOCK_NEW.format(i="  ") + "\n  max_requests: max_num_seqs\n",
    ),
}
META = "meta:\n  keep: &S [2]\n  range: &R {start: 2, stop: 4, step: 2}\n"


def _text(capture: str, extra: str = "") -> str:
    return HEAD + capture + TAIL + extra


def _encode(text: str, newline: str, bom: bool) -> bytes:
    return (b"\xef\xbb\xbf" if bom else b"") + text.replace("\n", newline).encode("utf-8")


def _spec_text(name: str, capture: str) -> str:
    if name.startswith("aliased"):  # the anchors come first, in meta
        return HEAD.replace("capture:\n", META + "capture:\n") + capture + TAIL
    return _text(capture)


NEWLINES = {"lf": "\n", "crlf": "\r\n", "cr": "\r"}


@pytest.mark.parametrize("bom", [False, True], ids=["plain", "bom"])
@pytest.mark.parametrize("newline", list(NEWLINES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_write_keeps_every_byte_outside_the_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str, newline: str, bom: bool
) -> None:
    before, after = LAYOUTS[layout]
    path = tmp_path / "spec.yaml"
    old = _encode(_spec_text(layout, before), NEWLINES[newline], bom)
    path.write_bytes(old)
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    code = main(["sizes", str(path), "--max-waste", "0", "--write"])
    err = capsys.readouterr().err
    assert code == 0, err
    want = _encode(_spec_text(layout, after), NEWLINES[newline], bom)
    assert path.read_bytes() == want
    assert main(["check", str(path), "--strict"]) == 0, capsys.readouterr().err
    data = parse_yaml(path.read_bytes().decode("utf-8-sig"), "spec.yaml")
    assert data["capture"]["sizes"] == [2, 4, 6, 8]
    capsys.readouterr()


# Layouts refused before the file is touched: (capture lines, extra tail text, the reason in stderr).
REFUSED: dict[str, tuple[str, str, str]] = {
    "anchor-used-elsewhere": (
        "  sizes: &S [2]\n  max_requests: max_num_seqs\n",
        "meta: {copy: *S}\n",
        "would change more than capture.sizes",
    ),
    "item-anchor-used-elsewhere": (
        "  sizes: [&two 2]\n  max_requests: max_num_seqs\n",
        "meta: {copy: *two}\n",
        "capture.sizes: its item anchor &two is used at line 11; replacing the items would drop it",
    ),
    "map-tag": (
        "  sizes: !!map {start: 2, stop: 4, step: 2}\n  max_requests: max_num_seqs\n",
        "",
        "carries the tag 'tag:yaml.org,2002:map'",
    ),
}


@pytest.mark.parametrize("newline", list(NEWLINES))
@pytest.mark.parametrize("layout", list(REFUSED))
def test_a_layout_the_edit_cannot_keep_is_refused_and_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str, newline: str
) -> None:
    capture, extra, reason = REFUSED[layout]
    path = tmp_path / "spec.yaml"
    old = _encode(_text(capture, extra), NEWLINES[newline], True)
    path.write_bytes(old)
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    assert main(["sizes", str(path), "--max-waste", "0", "--write"]) == 2
    err = capsys.readouterr().err
    assert reason in err and "undefined alias" not in err.replace("rewritten", "")
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_a_merged_capture_is_refused_with_where_to_edit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        "version: 1\nname: rt\nconstants:\n  max_num_seqs: 4\n"
        "meta:\n  base: &C {tokens_per_request: 2, sizes: [2], max_requests: max_num_seqs}\n"
        "capture:\n  <<: *C\n" + TAIL
    )
    path = tmp_path / "spec.yaml"
    path.write_bytes(text.encode())
    assert main(["sizes", str(path), "--max-waste", "0", "--write"]) == 2
    assert (
        "capture.sizes: comes from a merge key (<<); edit it where it is defined" in capsys.readouterr().err
    )
    assert path.read_bytes() == text.encode()


def test_the_known_crlf_alias_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The reproduction from issue 21: a valid CRLF spec whose capture.sizes is an alias exited 2 ("found
    undefined alias" about graphbuf's own rewrite) and the "restored" file had lost every CR byte."""
    path = tmp_path / "spec.yaml"
    old = _encode(_spec_text("aliased", LAYOUTS["aliased"][0]), "\r\n", False)
    path.write_bytes(old)
    assert main(["sizes", str(path), "--write"]) == 0, capsys.readouterr().err
    new = path.read_bytes()
    assert new.count(b"\r\n") == old.count(b"\r\n") and new.count(b"\n") == new.count(b"\r\n")
    assert b"keep: &S [2]" in new


def test_a_failed_write_leaves_the_file_byte_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "spec.yaml"
    old = _encode(_text(LAYOUTS["block"][0]), "\r\n", True)
    path.write_bytes(old)
    os.chmod(path, 0o640)

    def fail(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    assert main(["sizes", str(path), "--max-waste", "0", "--write"]) == 2
    assert "cannot write: No space left on device; the file is unchanged" in capsys.readouterr().err
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # no temporary file left behind
    monkeypatch.undo()
    assert main(["sizes", str(path), "--max-waste", "0", "--write"]) == 0
    assert os.stat(path).st_mode & 0o777 == 0o640  # the permissions stay


def test_sizes_that_would_not_load_are_refused_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    old = _encode(_text(LAYOUTS["flow"][0]), "\r", False)
    path.write_bytes(old)
    with pytest.raises(SpecError, match=r"would not load \(file unchanged\)[\s\S]*not a multiple"):
        write_sizes(path, (3, 4))
    assert path.read_bytes() == old


@st.composite
def _layout(draw: st.DrawFn) -> tuple[str, str]:
    """A spec text (LF) with capture.sizes in a drawn style, and the newline to write it with."""
    ind = draw(st.sampled_from(["  ", "    ", " "]))
    props = draw(st.sampled_from(["", "&mine ", "!!seq ", "&mine !!seq "]))
    comment = draw(st.sampled_from(["", "  # c", "\t# tab", " #"]))
    sizes = sorted(draw(st.lists(st.sampled_from([2, 4, 6, 8]), min_size=1, max_size=4, unique=True)))
    style = draw(st.sampled_from(["flow", "block", "indentless", "range", "alias"]))
    if style == "flow":
        value = f" {props}[{', '.join(map(str, sizes))}]{comment}\n"
    elif style in ("block", "indentless"):
        item = ind + ind if style == "block" else ind
        lines = [f"{item}- {n}{draw(st.sampled_from(['', comment]))}\n" for n in sizes]
        if draw(st.booleans()):
            lines.insert(draw(st.integers(0, len(lines))), f"{item}# inside\n")
        value = f" {props}".rstrip(" ") + f"{comment}\n" + "".join(lines)
    elif style == "range":
        value = " {start: 2, stop: 4, step: 2}" + comment + "\n"
    else:
        value = " *S" + comment + "\n"
    before = draw(st.sampled_from(["", f"{ind}# before\n", "\n"]))
    capture = (
        f"capture:{comment}\n{ind}tokens_per_request: 2\n{before}{ind}sizes:{value}{ind}max_requests: n\n"
    )
    head = "version: 1\nname: fuzz\nconstants: {n: 4}\n"
    meta = "meta:\n  keep: &S [2, 4]\n" if style == "alias" else ""
    tail = "buffers:\n  a: {dtype: int32, rows: tokens}\n" + draw(st.sampled_from(["", "# end\n", "# end"]))
    return head + meta + capture + tail, draw(st.sampled_from(list(NEWLINES.values())))


def _lines(text: str) -> list[str]:
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


@settings(
    max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(layout=_layout(), bom=st.booleans())
def test_drawn_layouts_keep_their_bytes_or_are_refused_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: tuple[str, str], bom: bool
) -> None:
    text, newline = layout
    path = tmp_path / "fuzz.yaml"
    old = _encode(text, newline, bom)
    path.write_bytes(old)
    code = main(["sizes", str(path), "--max-waste", "0", "--write"])
    err = capsys.readouterr().err
    new = path.read_bytes()
    if code != 0:
        assert new == old and "undefined alias" not in err, err
        return
    assert new.startswith(b"\xef\xbb\xbf") == bom
    body = new.decode("utf-8-sig")
    stray = {"\n": "\r", "\r": "\n", "\r\n": None}[newline]
    bare = body.replace("\r\n", "") if newline == "\r\n" else body
    assert (stray not in bare) if stray else ("\r" not in bare and "\n" not in bare), repr(body)
    data = parse_yaml(body, "fuzz.yaml")
    want = parse_yaml(text, "fuzz.yaml")
    want["capture"]["sizes"] = [2, 4, 6, 8]
    assert data == want
    kept = [
        line for line in _lines(text) if "sizes:" not in line and not line.lstrip().startswith(("- ", "#"))
    ]
    new_lines = _lines(body)
    assert all(line in new_lines for line in kept)  # every line outside the sizes value survives
    comments = [line.strip() for line in _lines(text) if line.lstrip().startswith("#")]
    assert all(any(c in line for line in new_lines) for c in comments)  # comments kept, none dropped
