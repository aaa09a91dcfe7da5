"""A user pipeline for `gpufeed doctor module:function` tests: batches that take long to make."""

import time

import torch


def batches():
    for _ in range(8):
        time.sleep(0.02)
        yield torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.int64)
