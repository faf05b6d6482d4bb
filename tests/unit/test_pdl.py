"""The programmatic-dependent-launch switch: never on off the GPU, off when disabled."""

import torch

from octavo.kernels import pdl


def test_pdl_is_off_on_the_cpu():
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.pdl_args(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}


def test_disabled_pdl_never_asks_the_device(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    # A CUDA device on a machine without one: the switch must answer before touching it.
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
