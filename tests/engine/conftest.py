"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from tests.models.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny float32 Llama with GQA (2 KV heads); a module may override it."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama",
                                num_key_value_heads=2)
