"""Document masking (models/common/document_mask.py): document ids from packed token ids, and the oracles of
block-causal attention: a packed window trains exactly like its documents run alone (one process, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import get_model_args, get_model_spec
from models.common.document_mask import document_attention, document_ids, document_positions
from models.registry import load_ref

BOS, EOS = 1, 2


def build(name: str, seed: int = 0) -> torch.nn.Module:
    args = get_model_args(name, "debugmodel_tiny")
    model = load_ref(get_model_spec(name).model_cls)(args)
    model.init_weights(seed)
    return model


def packed_window(lengths: list[int], eos: bool, generator: torch.Generator, head: int = 0) -> torch.Tensor:
    """LongTensor [sum + head]: ``head`` tokens of a document begun earlier (no BOS), then one
    document per length, each [BOS] + text (+ [EOS]) as engine/data/packing.py packs them."""
    parts = [torch.randint(3, 4096, (head,), generator=generator)]
    for n in lengths:
        body = torch.randint(3, 4096, (n - 1 - int(eos),), generator=generator)
        parts.append(torch.cat([torch.tensor([BOS]), body] + ([torch.tensor([EOS])] if eos else [])))
    return torch.cat(parts)


def test_document_ids_and_positions_from_bos():
    # Two separators (BOS 1 ... EOS 2) and one (BOS is EOS, GPT-2's <|endoftext|>): ids count BOS.
    tokens = torch.tensor([[7, 2, 1, 5, 2, 1, 9, 9], [1, 4, 4, 1, 1, 3, 3, 3]])
    docs = document_ids(tokens, BOS)
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 2, 2], [1, 1, 1, 2, 3, 3, 3, 3]]
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 0, 1, 2, 3]]


def _loss_and_grads(model, tokens, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = model(tokens, **kwargs)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("restart", [True, False])
@pytest.mark.parametrize("eos", [True, False], ids=["bos+eos", "bos_is_eos"])
def test_packed_window_equals_its_documents_alone(name, restart, eos):
    """Loss and every gradient of a packed batch with masking == the sums over its documents, each run
    alone as its own sequence (restart) or alone at its window positions (no restart), fp32."""
    torch.manual_seed(0)
    model = build(name)
    gen = torch.Generator().manual_seed(1)
    windows = [packed_window([9, 4, 12], eos, gen, head=7), packed_window([20, 5, 7], eos, gen)]
    stream = torch.stack(windows)  # [2, 33]: windows plus the next token, as the loader cuts them
    tokens, labels = stream[:, :-1], stream[:, 1:]
    docs = document_ids(tokens, BOS)
    kwargs = {"documents": docs}
    if restart:
        kwargs["positions"] = document_positions(docs)
    loss, grads = _loss_and_grads(model, tokens, labels, **kwargs)

    want_loss, want_grads, segments = 0.0, None, 0
    for b in range(tokens.shape[0]):
        for d in docs[b].unique().tolist():
            where = (docs[b] == d).nonzero().flatten()
            start, end = int(where[0]), int(where[-1]) + 1
            positions = None if restart else torch.arange(start, end)
            seg_loss, seg_grads = _loss_and_grads(model, tokens[b:b + 1, start:end], labels[b:b + 1, start:end],
                                                  positions=positions)
            want_loss += seg_loss
            want_grads = seg_grads if want_grads is None else {n: want_grads[n] + g for n, g in seg_grads.items()}
            segments += 1
    assert segments == 7
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    # The mask matters: plain causal attention over the same window gives another loss (by over 10
    # times the tolerance above; the untrained model's predictions are near uniform either way).
    causal_loss, _ = _loss_and_grads(model, tokens, labels)
    assert abs(float(causal_loss - loss)) > 1e-4 * float(loss)


@pytest.mark.parametrize("name", ["llama", "qwen3", "moe"])
def test_one_document_window_is_todays_causal_result_exactly(name):
    torch.manual_seed(0)
    model = build(name)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.stack([packed_window([32], True, gen), torch.randint(3, 4096, (32,), generator=gen)])
    labels = torch.randint(3, 4096, (2, 32), generator=gen)
    docs = document_ids(tokens, BOS)
    want_loss, want_grads = _loss_and_grads(model, tokens, labels)
    for kwargs in ({"documents": docs}, {"documents": docs, "positions": document_positions(docs)}):
        loss, grads = _loss_and_grads(model, tokens, labels, **kwargs)
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(g, want_grads[n]) for n, g in grads.items())


def test_moe_family_masks_through_the_shared_attention():
    """The MoE family's logits of each document alone equal its packed window's (forward: routing is
    per token, so the balance statistics are the only thing the layout of a batch changes)."""
    torch.manual_seed(0)
    model = build("moe")
    gen = torch.Generator().manual_seed(3)
    tokens = packed_window([10, 6, 16], True, gen)[None]
    docs = document_ids(tokens, BOS)
    with torch.no_grad():
        packed = model(tokens, documents=docs, positions=document_positions(docs))
        alone = torch.cat([model(tokens[:, s:e]) for s, e in ((0, 10), (10, 16), (16, 32))], dim=1)
        causal = model(tokens)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed, causal, rtol=1e-3, atol=1e-3)


def test_dense_attention_matches_per_document_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    docs = torch.tensor([[0] * 5 + [1] * 11, [2] * 16])
    out = document_attention(q, k, v, docs)
    for b, spans in ((0, [(0, 5), (5, 16)]), (1, [(0, 16)])):
        for s, e in spans:
            alone = F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                   is_causal=True)
            torch.testing.assert_close(out[b:b + 1, :, s:e], alone)
    with pytest.raises(ValueError, match="document ids of shape"):
        document_attention(q, k, v, docs[:, :8])
