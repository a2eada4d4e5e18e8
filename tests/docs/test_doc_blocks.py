"""Every code block of the documentation runs: the pages' ```python blocks and the docstrings' ``>>>`` examples.

See ``doc_blocks`` for how blocks are found and run (1 rank unless ``# ranks: N``; pooled Gloo workers).
"""

from __future__ import annotations

import pytest

from tensorplay.testing.distributed import run_distributed

from tests.docs import doc_blocks

BLOCKS = doc_blocks.page_blocks()
DOCTESTS = sorted(doc_blocks.docstring_tests())


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_page_block_runs(block: doc_blocks.Block, tmp_path) -> None:
    if block.skip_reason:
        pytest.skip(block.skip_reason)
    run_distributed(doc_blocks.exec_block, block.source, block.id, str(tmp_path), world_size=block.world_size)


@pytest.mark.parametrize("name", DOCTESTS)
def test_docstring_example_runs(name: str, tmp_path) -> None:
    (report,) = run_distributed(doc_blocks.run_docstring, name, str(tmp_path), world_size=1)
    assert report == "", report


def test_the_collector_finds_blocks() -> None:
    assert len(BLOCKS) >= 10, [b.id for b in BLOCKS]
    assert all(b.world_size in (1, 2) for b in BLOCKS), "keep doc blocks on 1-2 ranks (CI has 2 cores)"


def test_a_failing_block_fails(tmp_path) -> None:
    from tensorplay.testing.distributed import RankFailure

    with pytest.raises(RankFailure, match="ZeroDivisionError"):
        run_distributed(doc_blocks.exec_block, "x = 1 / 0", "bad", str(tmp_path), world_size=1)
