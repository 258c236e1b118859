"""Host tensors sent to the device together (kvlm.core.staging): each comes back whole, in its shape, as int64."""
from __future__ import annotations

import numpy as np
import torch

from kvlm.core.staging import staged, staged_together


def test_tensors_sent_together_come_apart_as_they_were():
    rows = torch.tensor([5, 3, 9])
    cells = torch.arange(12, dtype=torch.int32).view(3, 4)
    empty = torch.zeros(0, dtype=torch.int64)
    strided = torch.from_numpy(np.arange(10)[::2])
    got = staged_together("cpu", rows, cells, empty, strided)
    for sent, back in zip((rows, cells, empty, strided), got):
        assert back.dtype == torch.int64 and back.shape == sent.shape
        assert torch.equal(back, sent.to(torch.int64))


def test_a_tensor_staged_for_the_cpu_is_itself():
    t = torch.randn(3)
    assert staged(t, "cpu") is t
