"""`minillm doctor` names the driver/CUDA mismatch that leaves a GPU unused (issue seen on
Colab: PyPI's torch 2.13.0 is a CUDA 13 build and needs driver >= 580)."""

from minillm.doctor import driver_problem


def test_an_old_driver_under_a_cuda13_torch_is_named_with_the_fix():
    why = driver_problem("13.0", "550.54.15", cuda_ok=False)
    assert why is not None and ">= 580" in why and "550.54.15" in why and "Fix" in why


def test_no_problem_when_cuda_works_or_nothing_to_compare():
    assert driver_problem("13.0", "550.54.15", cuda_ok=True) is None  # it works after all
    assert driver_problem(None, "550.54.15", cuda_ok=False) is None  # a CPU build of torch
    assert driver_problem("13.0", None, cuda_ok=False) is None  # no NVIDIA driver at all
    assert driver_problem("13.0", "580.159.04", cuda_ok=False) is None  # new enough
    assert driver_problem("12.6", "530.30.02", cuda_ok=False) is None
