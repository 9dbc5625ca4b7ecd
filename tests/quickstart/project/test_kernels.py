"""The project's own tests: plain pytest, nothing of pallas_guard in them."""

import numpy as np
from kernels import add, add_then_scale, ones, scale_in_blocks


def test_add() -> None:
    np.testing.assert_array_equal(add(ones(8), ones(8)), 2 * np.ones((8, 128)))


def test_scale_in_blocks() -> None:
    np.testing.assert_array_equal(scale_in_blocks(ones(32)), 2 * np.ones((32, 128)))


def test_jitted_pipeline() -> None:
    np.testing.assert_array_equal(add_then_scale(ones(16), ones(16)), 4 * np.ones((16, 128)))
