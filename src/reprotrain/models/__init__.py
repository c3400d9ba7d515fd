"""reprotrain's built-in models: plain `nn.Module`s, each named by a YAML file in conf/model/.

    model=mlp   reprotrain.models.MLP        the course's SimpleMLP (784 -> 512 -> 10)
    model=cnn   reprotrain.models.SmallCNN   two conv blocks on C x H x W images (digits as 1x8x8)

A model of your own is built the same way: `_target_: my_project.models.MyNet` in a YAML file.
"""

from reprotrain.models.cnn import SmallCNN
from reprotrain.models.mlp import MLP

__all__ = ["MLP", "SmallCNN"]
