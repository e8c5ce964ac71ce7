"""Pipeline stages for DeepSeek-V3 tiny with MTP (tests/test_pipeline.py has the rest): each mesh below equals
one device's step in loss, gradients, router state and metrics, and its compiled program's timeline shows the
schedule's bubble."""
from test_pipeline import DEEPSEEK, check_stages_equal_one_device, stage_cases


def test_deepseek_stages_equal_one_device():
    """The meshes where DeepSeek's own parts meet the stages: the stage's forward run again (stage4), circular
    stages (repeats2), the token all-to-all over an expert axis inside the stages with offloaded expert inputs
    (expert4); each checks the router state, MTP and balance losses. Plain stage2 x fsdp4 is Llama's
    (tests/test_pipeline.py): a fourth DeepSeek compile pair there found nothing the others do not."""
    cases = stage_cases("deepseek", DEEPSEEK)
    del cases["deepseek stage2 fsdp4"]
    check_stages_equal_one_device(cases)
