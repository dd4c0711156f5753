"""Model shapes from the dissertation and a prediction helper shared by the planner tests."""

from ptdp.planner.compute import ModelShape
from ptdp.planner.cost_model import Layout, Workload, predict


def gpt(layers, hidden, heads, seq=2048, vocab=51200, dropout=True):
    return ModelShape("gpt", layers, hidden, heads, 4 * hidden, seq, vocab, dropout)


GPT3_175B = gpt(96, 12288, 96)
GPT_145B = gpt(80, 12288, 96)          # Fig. 4.17
GPT_162B = gpt(32, 20480, 128)         # Fig. 4.13
GPT_5_9B = gpt(32, 3840, 32)           # Figs. 4.14, 4.15
GPT_530B = gpt(105, 20480, 128)        # Table 4.2
GPT_1T = gpt(128, 25600, 160)          # Eq. 4.4 example


def run(hw, shape, batch, layout, attention=None, gpus_per_node=8, precision="bf16"):
    return predict(hw, Workload(shape, batch, precision, gpus_per_node), layout,
                   attention=attention)


__all__ = ["gpt", "run", "Layout", "GPT3_175B", "GPT_145B", "GPT_162B", "GPT_5_9B",
           "GPT_530B", "GPT_1T"]
