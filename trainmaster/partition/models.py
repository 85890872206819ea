"""Small real models to partition from the CLI (``module:callable``) and in the pipeline demo.

torchvision does not import here, so these are built by hand: an MLP and an Inception-style
CNN with parallel branches (the shape where placement across devices matters).
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(width: int = 256, depth: int = 6, inputs: int = 64, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class InceptionBlock(nn.Module):
    """Four parallel branches concatenated, as in Inception-V3."""

    def __init__(self, cin: int, c: int):
        super().__init__()
        self.b1 = nn.Conv2d(cin, c, 1)
        self.b3 = nn.Sequential(nn.Conv2d(cin, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(cin, c, 1), nn.ReLU(), nn.Conv2d(c, c, 5, padding=2))
        self.pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(cin, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), self.pool(x)], dim=1))


def inception(blocks: int = 3, width: int = 16, classes: int = 10) -> nn.Module:
    """Input (N, 3, H, W)."""
    mods: list[nn.Module] = [nn.Conv2d(3, 4 * width, 3, padding=1), nn.ReLU()]
    for _ in range(blocks):
        mods.append(InceptionBlock(4 * width, width))
    mods += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, classes)]
    return nn.Sequential(*mods)


def encoder(width: int = 64, heads: int = 4, layers: int = 2) -> nn.Module:
    """A bare nn.TransformerEncoder (batch first), input (N, S, width): the module whose fused
    inference fast path a module-level trace hides inside one opaque node."""
    layer = nn.TransformerEncoderLayer(width, heads, 2 * width, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, plus the (projected) input."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def resnet_like(width: int = 32, classes: int = 10) -> nn.Module:
    """A small ResNet (8 basic blocks in 4 stages, as ResNet-18), input (N, 3, H, W)."""
    blocks: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage, mult in enumerate((1, 2, 4, 8)):
        for i in range(2):
            stride = 2 if stage > 0 and i == 0 else 1
            blocks.append(BasicBlock(cin, width * mult, stride))
            cin = width * mult
    blocks += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*blocks)


def gpt2_small(layers: int = 4, width: int = 256, heads: int = 4, vocab: int = 1024, positions: int = 128) -> nn.Module:
    """A GPT-2 configuration from ``transformers`` with random weights (no download), smaller
    than GPT-2 small (12 x 768) so that it runs on a CPU in seconds; input token ids (N, S)
    below ``vocab`` (the pipeline's ``input_dtype: tokens:1024``). Traced with torch.export."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocab,
        n_positions=positions,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2Model(config)


def bert_small(layers: int = 4, width: int = 192, heads: int = 3, vocab: int = 1024, positions: int = 128) -> nn.Module:
    """A BERT encoder configuration from ``transformers`` with random weights (no download),
    input token ids (N, S) below ``vocab``: a bidirectional encoder with a pooler, beside the
    decoder-only GPT-2. Traced with torch.export."""
    import transformers

    config = transformers.BertConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        vocab_size=vocab,
        max_position_embeddings=positions,
    )
    return transformers.BertModel(config)


def gpt2_lm(layers: int = 6, width: int = 256, heads: int = 4, vocab: int = 8192, positions: int = 128) -> nn.Module:
    """A GPT-2 language model (``GPT2LMHeadModel``: the blocks and the vocabulary head) from a
    ``transformers`` config with random weights (no download), input token ids (N, S) below
    ``vocab``. The head's weights are not tied to the embedding's: a pipeline puts them on
    different stages, and ``torch.distributed.pipelining`` would otherwise have to keep a
    shared parameter in step across stages. Returns the logits alone (``use_cache`` off), as a
    pipeline's last stage hands them on."""
    import transformers

    class GPT2Logits(transformers.GPT2LMHeadModel):
        def forward(self, input_ids):  # type: ignore[override]
            return super().forward(input_ids=input_ids).logits

    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocab,
        n_positions=positions,
        use_cache=False,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2Logits(config)
