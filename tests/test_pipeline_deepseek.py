"""Pipeline stages for DeepSeek-V3 tiny with MTP (tests/test_pipeline.py has the rest): each mesh of MESHES equals
one device's step in loss, gradients, router state and metrics, and its compiled program's timeline shows the
schedule's bubble (issue 45 asks all four meshes for both families)."""
from test_pipeline import DEEPSEEK, check_stages_equal_one_device, stage_cases


def test_deepseek_stages_equal_one_device():
    check_stages_equal_one_device(stage_cases("deepseek", DEEPSEEK))
