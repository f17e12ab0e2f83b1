"""More pins for ``graphbuf/buffers/bound.py`` (issue 24 §2): the messages of ``bind`` and of a bound refresh,
and the in-place change checks; each test names the mutant it kills (mutmut's names, numpy path)."""

from __future__ import annotations

import numpy as np
import pytest
from paged_spec import PAGED_SPEC

from graphbuf import AddressChangedError, GraphSpec, RefreshError, RowsError, StaticBuffers


def _sb() -> StaticBuffers:
    return StaticBuffers(GraphSpec.model_validate(PAGED_SPEC))


def _host() -> dict[str, np.ndarray]:
    return {"block_table": np.zeros((8, 8), np.int32), "seq_lens": np.full(8, 4, np.int32)}


def test_a_source_shorter_than_the_largest_capture_is_refused_at_bind() -> None:
    """``_entry__mutmut_24``: the message starts with ``bind()`` and the buffer."""
    src = {**_host(), "seq_lens": np.zeros(5, np.int32)}
    with pytest.raises(RowsError) as err:
        _sb().bind(src)
    assert str(err.value) == (
        "bind(): buffer 'seq_lens': source has 5 rows; the largest capture reads up to 8 (rows = requests)"
    )


def test_an_unsupported_source_type_is_named_at_bind() -> None:
    """``_host_array__mutmut_17``: the message names the type given."""
    with pytest.raises(RefreshError, match=r"^bind\(\): buffer 'seq_lens': unsupported source type list; "):
        _sb().bind({**_host(), "seq_lens": [4] * 8})


def test_a_bound_refresh_on_the_checked_path_names_the_call() -> None:
    """``_prepare_checked__mutmut_6``: a value out of bounds sends the refresh to the checked path, whose
    errors start with the call's label."""
    sb, host = _sb(), _host()
    bound = sb.bind(host)
    host["seq_lens"][1] = 99
    with pytest.raises(RefreshError, match=r"^refresh\(size=4\): buffer 'seq_lens': value 99"):
        sb.refresh(4, bound, num_reqs=3)


def test_num_reqs_out_of_range_names_the_call_and_the_size() -> None:
    """``prepare__mutmut_8``: the label is the call's, not the size."""
    sb = _sb()
    bound = sb.bind(_host())
    with pytest.raises(RowsError) as err:
        sb.refresh(4, bound, num_reqs=5)
    assert str(err.value) == "refresh(size=4): num_reqs=5, but capture size 4 holds 0..4 requests"


def test_a_1_d_bound_array_resized_in_place_is_refused_with_the_whole_reason() -> None:
    """``check_moved__mutmut_4``/``_7``/``_13``: a 1-D resize keeps the strides and changes the shape
    (``or``, not ``and``); the message says what happened and what to do."""
    sb, host = _sb(), _host()
    bound = sb.bind(host)
    lens = host["seq_lens"]
    lens.resize((16,), refcheck=False)
    with pytest.raises(AddressChangedError) as err:
        sb.refresh(4, bound, num_reqs=2)
    assert str(err.value) == (
        "refresh(size=4): bound source 'seq_lens' changed in place: bound with shape [8] strides [4], now "
        "shape [16] strides [4]; a bound numpy array must keep its shape (ndarray.resize and .shape= change "
        "it): bind it again"
    )
