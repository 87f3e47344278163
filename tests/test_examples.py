"""The hook examples on a real engine (tiny model): their numbers equal a reimplementation of
the same procedure on Hugging Face transformers fp32 (causal tracing, the logit lens), and
the others run and change what they should."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import vllm_hook
from tests.helpers import browser, hf_ref
from tests.helpers.common import PROMPTS, ids_of, rel_err, run, sp
from tests.test_hooks import hooks_engine
from vllm_hook.testing.tiny_models import tiny_model

pytestmark = pytest.mark.engine
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import activation_oracle  # noqa: E402
import activation_patching  # noqa: E402
import attnlink  # noqa: E402
import causal_tracing  # noqa: E402
import deception_probe  # noqa: E402
import emotion_tracker  # noqa: E402
import hnode_probe  # noqa: E402
import instruction_steering  # noqa: E402
import jacobian_lens  # noqa: E402
import logit_lens  # noqa: E402
import neuron_ablation  # noqa: E402
import sae_readout  # noqa: E402
import science_hallucination  # noqa: E402


@pytest.fixture
def llm(engines):
    return hooks_engine(engines)


@torch.no_grad()
def _hf_prob(hf, ids, hooks):
    with hf_ref.python_hooks(hf, hooks, len(ids)) as ctxs:
        hf(torch.tensor([ids]))
    return float(ctxs[-1].saved["p"])


@torch.no_grad()
def test_causal_tracing_equals_hf(llm, tmp_path):
    """The restoration map equals the same hooks on HF (rel 1e-4); its HTML view renders in
    headless Chromium."""
    hf = hf_ref.load(tiny_model("qwen2"))
    ids = ids_of(llm, "Paris is the capital of France")
    subject = [0, 1]
    answer = 17
    noise = causal_tracing.noise_for(len(subject), 128, 3.0)
    got = causal_tracing.trace(llm, ids, subject, answer, noise)
    # The same procedure on HF: its own clean states, the same hook functions.
    n = 4
    read = causal_tracing.answer_prob_hook(n, answer)
    corrupt = causal_tracing.corrupt_hook(subject, noise)
    clean_states, _ = hf_ref.activations(hf, ids)
    assert abs(_hf_prob(hf, ids, [read]) - got["clean"]) <= 1e-4 * got["clean"]
    assert abs(_hf_prob(hf, ids, [corrupt, read]) - got["corrupted"]) <= 1e-4 * got["corrupted"]
    ref = torch.zeros(n, len(ids))
    for L in range(n):
        for t in range(len(ids)):
            ref[L, t] = _hf_prob(hf, ids, [corrupt, causal_tracing.restore_hook(L, t, clean_states["resid_post"][L][t]),
                                           read])
    assert rel_err(got["restored"], ref) <= 1e-4, (got["restored"], ref)
    assert got["clean"] != got["corrupted"]
    # Restoring every token at the last layer gives back the clean run at the last token.
    assert abs(float(got["restored"][n - 1, len(ids) - 1]) - got["clean"]) <= 1e-4 * got["clean"]
    words = [llm.get_tokenizer().decode([i]) for i in ids]
    page = causal_tracing.html_view(got, words, str(tmp_path / "trace.html"))
    browser.assert_renders(page, tmp_path / "trace.png")


@torch.no_grad()
def test_logit_lens_equals_hf(llm):
    hf = hf_ref.load(tiny_model("qwen2"))
    prompts = [PROMPTS[0], PROMPTS[3]]
    lens, outs = logit_lens.run(llm, prompts, k=3, max_tokens=3)
    for lz, o in zip(lens, outs):
        seq = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:-1]
        ref, _ = hf_ref.activations(hf, seq)
        for L in range(4):
            probs = hf.lm_head(hf.model.norm(ref["resid_post"][L])).softmax(-1)
            top = probs.topk(3)
            assert torch.equal(lz["ids"][L, :len(seq)], top.indices)
            assert rel_err(lz["p"][L, :len(seq)], top.values) <= 1e-4


def test_activation_patching_and_neuron_ablation_and_sae(llm):
    s, t = ids_of(llm, "Paris is the capital of"), ids_of(llm, "Berlin is the capital of")
    if len(s) != len(t):
        pytest.skip("the tiny tokenizer splits the two names differently")
    res = activation_patching.patch(llm, s, t, answer=17)
    # Patching the last layer's last token makes the target read the source's answer probability.
    assert abs(float(res["patched"][3, -1]) - res["source"]) <= 1e-4 * res["source"]
    ab = neuron_ablation.ablate(llm, [ids_of(llm, p) for p in neuron_ablation.PROMPTS], 1, list(range(16)))
    assert all(r["kl"] > 0 for r in ab)
    assert all(torch.allclose(r["plain"].exp().sum(), torch.tensor(1.0), atol=1e-4) for r in ab)
    sae = sae_readout.random_sae(128, 512)
    (r,) = sae_readout.readout(llm, [ids_of(llm, PROMPTS[1])], 2, sae, k=4)
    f = torch.relu((r["stream"] - sae["b_dec"]) @ sae["W_enc"] + sae["b_enc"]).topk(4)
    assert torch.equal(r["features"][:len(f.indices)], f.indices)
    assert rel_err(r["activations"][:len(f.values)], f.values) <= 1e-5


@torch.no_grad()
def test_jacobian_lens_equals_hf(llm):
    """Fit once on the tiny model (HF, fp32), read out in the engine and in HF: the same top-k
    ids and log-probabilities within 1e-4 at every row and layer; the baseline readout is the
    plain logit lens; a fitted Jacobian matches finite differences of the model."""
    from vllm_hook.analyzers import jacobian_lens as jl

    hf = hf_ref.load(tiny_model("qwen2"))
    fit_ids = ids_of(llm, PROMPTS[1])
    with torch.enable_grad():
        jac = jl.fit(hf, [fit_ids], layers=[1, 2, 3], positions_per_prompt=3)
    assert torch.equal(jac[3], torch.eye(128))                   # the last layer's: identity
    prompts = [ids_of(llm, PROMPTS[0]), ids_of(llm, PROMPTS[3])]
    for baseline in (False, True):
        got = jacobian_lens.read(llm, prompts, jac, k=4, baseline=baseline, max_tokens=3)
        for ids, g in zip(prompts, got):
            ref = jl.hf_readout(hf, ids, jac, k=4, baseline=baseline)
            P = len(ids)
            for L, (r_ids, r_lp) in ref.items():
                assert torch.equal(g[L][0][:P], r_ids), (baseline, L)
                assert rel_err(g[L][1][:P], r_lp) <= 1e-4, (baseline, L)
    # The transport is not the identity below the last layer: it changes the readout.
    plain = jl.hf_readout(hf, prompts[0], jac, k=4, baseline=True)
    lensed = jl.hf_readout(hf, prompts[0], jac, k=4)
    assert not torch.equal(plain[1][1], lensed[1][1])
    # One column of one token's Jacobian against central finite differences.
    clean = jl._stream(hf, fit_ids)[1]
    t = len(fit_ids) - 1
    with torch.enable_grad():
        J = jl._jacobian(hf, fit_ids, 1, t, clean)
    e = torch.zeros(128)
    e[5] = 1e-3

    def final(v):
        res = {}

        def rep(m, a, o):
            h = (o[0] if isinstance(o, tuple) else o).clone()
            h[0, t] = v
            return (h, *o[1:]) if isinstance(o, tuple) else h

        a = hf.model.layers[1].register_forward_hook(rep)
        b = hf.model.layers[-1].register_forward_hook(
            lambda m, a_, o: res.__setitem__("h", (o[0] if isinstance(o, tuple) else o)[0, t]))
        hf(torch.tensor([fit_ids]))
        a.remove()
        b.remove()
        return res["h"]

    fd = (final(clean[t] + e) - final(clean[t] - e)) / 2e-3
    assert rel_err(fd, J[:, 5]) <= 1e-2


@torch.no_grad()
def test_deception_probe_equals_hf(llm):
    """The persistent hook's features equal HF's (mean resid_post over the statement tokens,
    rel 1e-4); the probe fitted on them scores held-out pairs like the probe fitted on HF's
    (within 1e-3); the persistent hook is gone afterwards."""
    from vllm_hook.analyzers.hidden_state_probe import fit_probe

    hf = hf_ref.load(tiny_model("qwen2"))
    tok = llm.get_tokenizer()
    layer = 2
    train, test = deception_probe.STATEMENTS[:6], deception_probe.STATEMENTS[6:]
    probe, p, y = deception_probe.train_and_score(llm, layer, train, test)
    assert vllm_hook.stats(llm)["persistent_hooks"] == 0

    def hf_features(examples):
        rows = []
        for ids, _, m in examples:
            ref, _ = hf_ref.activations(hf, ids)
            rows.append(ref["resid_post"][layer][len(ids) - m:].mean(0))
        return torch.stack(rows)

    tr, te = deception_probe.pairs(tok, train), deception_probe.pairs(tok, test)
    eng = deception_probe.features(llm, tr, layer)
    ref = hf_features(tr)
    assert rel_err(eng, ref) <= 1e-4
    ref_probe = fit_probe(ref, [lab for _, lab, _ in tr], layer=layer)
    ref_p = ref_probe.probabilities(hf_features(te))
    assert p.shape == (len(te),) and y == [lab for _, lab, _ in te]
    assert float((p - ref_p).abs().max()) <= 1e-3, (p, ref_p)
    # On the training pairs the probe separates the instructions (random weights: by tokens).
    assert ((probe.probabilities(eng) > 0.5).long().tolist() == [lab for _, lab, _ in tr])


def test_instruction_and_language_steering_equal_hf(llm):
    """The contrastive direction equals HF's (rel 1e-4); adjust_rs sets every steered row's
    projection to avg_proj (1e-4); both configs' greedy tokens equal HF running the same ops
    for 8 steps; the language config changes the output."""
    from vllm_hook.analyzers.steering_vectors import SteeringConfig, direction_from_streams, steer_ops_from_config

    hf = hf_ref.load(tiny_model("qwen2"))
    tok = llm.get_tokenizer()
    configs = Path(instruction_steering.__file__).parent / "configs"
    prompts = [tok(q).input_ids for q in ("Write about the sea.", "Explain gravity.")]
    plain = instruction_steering.generate(llm, prompts, None, max_tokens=8)
    for name, instruction in (("instruction_steering", "Answer in exactly three bullet points."),
                              ("language_steering", "Answer in French.")):
        cfg = SteeringConfig.load(configs / f"{name}.json")
        d = instruction_steering.build(llm, instruction, cfg.layer)
        w, wo = instruction_steering.prompt_pairs(tok, instruction, instruction_steering.QUERIES)
        last = [torch.stack([hf_ref.activations(hf, ids)[0]["resid_post"][cfg.layer][-1] for ids in x]) for x in (w, wo)]
        ref = direction_from_streams(*last, cfg.layer)
        assert rel_err(d.vector, ref.vector) <= 1e-4 and abs(d.avg_proj - ref.avg_proj) <= 1e-4 * abs(ref.avg_proj)
        ops = steer_ops_from_config(d, cfg)
        got = instruction_steering.generate(llm, prompts, ops, max_tokens=8)
        for p, g in zip(prompts, got):
            assert g == hf_ref.greedy(hf, p, 8, ops)[0], name
        if cfg.method == "adjust_rs":
            spec = {"steer": ops, "capture": [{"layers": [cfg.layer]}]}
            out = run(llm, [prompts[0]], [sp(spec, max_tokens=4, ignore_eos=True)])[0]
            rows = vllm_hook.results(out).activations["resid_post"][cfg.layer]
            assert float((rows @ d.vector - d.avg_proj).abs().max()) <= 1e-4 * max(1.0, abs(d.avg_proj))
        else:
            assert got != plain



def test_hnode_probe_equals_hf(llm, tmp_path):
    """Every layer's last-token features equal HF's (rel 1e-4); the probe fitted on them picks
    the layer the HF-fitted probe picks, with the same H-Nodes, and scores every prompt within
    1e-3 of it; save/load keeps the scores."""
    from vllm_hook.analyzers.hnode import HNodeProbe, fit_hnode

    hf = hf_ref.load(tiny_model("qwen2"))
    probe, feats, labels, ev = hnode_probe.fit(llm)
    prompts, _, _ = hnode_probe.dataset(llm.get_tokenizer())
    acts = [hf_ref.activations(hf, ids)[0]["resid_post"] for ids in prompts]
    ref_feats = {L: torch.stack([a[L][-1] for a in acts]) for L in feats}
    for L in feats:
        assert rel_err(feats[L], ref_feats[L]) <= 1e-4, L
    ref = fit_hnode(ref_feats, labels, ev, n_nodes=8)
    assert probe.layer == ref.layer and probe.nodes.tolist() == ref.nodes.tolist()
    got, want = probe.score(feats[probe.layer]), ref.score(ref_feats[ref.layer])
    assert float((got.probabilities - want.probabilities).abs().max()) <= 1e-3
    assert float((got.h_node_excess - want.h_node_excess).abs().max()) <= 1e-4 * max(1.0, float(want.h_node_excess.abs().max()))
    assert set(probe.auc_per_layer) == set(feats) and all(0 <= a <= 1 for a in probe.auc_per_layer.values())
    probe.save(tmp_path / "hnode.safetensors")
    back = HNodeProbe.load(tmp_path / "hnode.safetensors")
    assert torch.allclose(back.score(feats[probe.layer]).probabilities, got.probabilities, atol=1e-6)


def test_attnlink_equals_hf(llm):
    """The candidates' scores equal the mean of HF's eager attention weights (the head's row
    from the last prompt token) over each candidate's span (rel 1e-4); the selection is the
    one the same nucleus rule gives on HF's scores; bad configs and missing captures are
    clear errors."""
    from vllm_hook import analyzers
    from vllm_hook.analyzers.attnlink import select

    hf = hf_ref.load(tiny_model("qwen2"))
    analyzer = analyzers.get("attnlink")(Path(attnlink.__file__).parent / "configs" / "attnlink.tiny-qwen2.json")
    r, p = attnlink.link(llm, analyzer)
    L, h = analyzer.config.layer, analyzer.config.head
    _, _, weights = hf_ref.attention(hf, p.token_ids)
    row = weights[L][h, len(p.token_ids) - 1]
    ref = torch.tensor([float(row[a:b].mean()) for a, b in (p.spans[c] for c in attnlink.CANDIDATES)])
    assert rel_err(torch.as_tensor(r.scores), ref) <= 1e-4
    ref_p, ref_rank, ref_sel = select(ref.tolist(), analyzer.config.temperature, analyzer.config.top_p)
    assert r.ranking == ref_rank and r.selected == ref_sel and abs(r.probabilities - ref_p).max() <= 1e-4
    assert abs(r.probabilities.sum() - 1) <= 1e-9 and 1 <= len(r.selected) <= len(attnlink.CANDIDATES)
    with pytest.raises(ValueError, match="top_p"):
        analyzers.get("attnlink")(layer=1, head=0, top_p=1.5)
    with pytest.raises(ValueError, match="attn_scores of layer 1 were not captured"):
        analyzers.get("attnlink")(layer=1, head=0).analyze(vllm_hook.results(run(llm, [p.token_ids], [sp({"capture": [{"layers": [1]}]}, max_tokens=1)])[0]), p.spans)


@torch.no_grad()
def test_science_hallucination_equals_hf(llm):
    """Pass 1's answers equal HF's greedy ones; the features (final norm of the last layer's
    output at the last token of prompt + answer[:-2]) equal HF's last_hidden_state (rel 1e-4);
    a 3-class probe fitted on them predicts what one fitted on HF's features predicts."""
    from vllm_hook.analyzers.hidden_state_probe import fit_probe

    hf = hf_ref.load(tiny_model("qwen2"))
    tok = llm.get_tokenizer()
    claims = science_hallucination.CLAIMS
    prompts = [science_hallucination.prompt_ids(tok, c, r) for c, r, _ in claims]
    x, answers = science_hallucination.features(llm, prompts, max_tokens=6)
    ref = []
    for p, a in zip(prompts, answers):
        assert a == hf_ref.greedy(hf, p, 6)[0]
        ref.append(hf.model(torch.tensor([p + a[:-2]])).last_hidden_state[0, -1])
    ref = torch.stack(ref)
    assert rel_err(x, ref) <= 1e-4
    y = [lab for _, _, lab in claims]
    got = fit_probe(x[:6], y[:6]).probabilities(x[6:])
    want = fit_probe(ref[:6], y[:6]).probabilities(ref[6:])
    assert got.shape == (3, 3) and float((got - want).abs().max()) <= 1e-3


@torch.no_grad()
def test_activation_oracle_with_lora_equals_hf_peft(engines, tmp_path):
    """The source activation equals HF's (rel 1e-4); injected at the placeholder with
    norm_match through a random LoRA adapter (vLLM's LoRARequest), the oracle's greedy tokens
    equal HF + PEFT with the same adapter and the same op for 8 steps; without the adapter
    they equal plain HF with the op; the adapter changes HF's logits."""
    from peft import PeftModel
    from vllm.lora.request import LoRARequest

    model = tiny_model("qwen2")
    lora_dir = activation_oracle.random_adapter(model, str(tmp_path / "lora"))
    llm = engines.get("qwen2-lora", arch="qwen2", enable_lora=True, max_lora_rank=8, max_loras=1)
    tok = llm.get_tokenizer()
    layer = 1
    src = tok("The Eiffel Tower is in Paris.").input_ids
    v = activation_oracle.source_activation(llm, src, layer)
    hf = hf_ref.load(model)
    assert rel_err(v, hf_ref.activations(hf, src)[0]["resid_post"][layer][-1]) <= 1e-4
    prompt, pos = activation_oracle.oracle_prompt(tok)
    ops = activation_oracle.injection(v, layer, pos)
    got = activation_oracle.ask(llm, LoRARequest("oracle", 1, lora_dir), prompt, ops)
    oracle = PeftModel.from_pretrained(hf_ref.load.__wrapped__(model), lora_dir).base_model.model.eval()
    want, want_logits = hf_ref.greedy(oracle, prompt, 8, ops)
    assert got == want
    base_tokens, base_logits = hf_ref.greedy(hf, prompt, 8, ops)
    assert activation_oracle.ask(llm, None, prompt, ops) == base_tokens
    assert float((want_logits - base_logits).abs().max()) > 1e-3


@torch.no_grad()
def test_emotion_tracker_equals_hf(llm, tmp_path):
    """The mean-stream features and the fitted directions equal HF's (rel 1e-4); the per-token
    scores of a prompt and its greedy continuation equal the same directions applied to HF's
    stream (rel 1e-4); the analyzer loads from a config file; the HTML view renders in
    headless Chromium and the PNG is written."""
    from vllm_hook.analyzers import get
    from vllm_hook.analyzers.emotion_tracker import fit_directions

    hf = hf_ref.load(tiny_model("qwen2"))
    tok = llm.get_tokenizer()
    layer = 2
    d = emotion_tracker.fit(llm, layer)

    def hf_mean(text):
        return hf_ref.activations(hf, tok(text).input_ids)[0]["resid_post"][layer].double().mean(0)

    want = fit_directions({k: torch.stack([hf_mean(t) for t in v]) for k, v in emotion_tracker.EXAMPLES.items()},
                          layer, neutral=torch.stack([hf_mean(t) for t in emotion_tracker.NEUTRAL]))
    assert d.names == want.names == list(emotion_tracker.EXAMPLES)
    assert rel_err(d.vectors, want.vectors) <= 1e-4 and rel_err(d.offsets, want.offsets) <= 1e-4
    d.save(tmp_path / "emotions.safetensors")
    (tmp_path / "emotions.json").write_text('{"analyzer": "emotion_tracker", "directions": "emotions.safetensors"}')
    tracker = get("emotion_tracker")(tmp_path / "emotions.json")
    trace, out, words = emotion_tracker.track(llm, tracker, ids_of(llm, PROMPTS[2]), 12)
    seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1]
    assert trace.positions.tolist() == list(range(len(seq))) and trace.prompt_len == len(out.prompt_token_ids)
    ref = d.scores(hf_ref.activations(hf, seq)[0]["resid_post"][layer])
    assert rel_err(torch.from_numpy(trace.scores), ref) <= 1e-4
    assert len(words) == len(seq) and len(trace.dominant) == len(seq)
    page = trace.to_html(tmp_path / "emotions.html", words)
    img = browser.assert_renders(page, tmp_path / "emotions-page.png")
    assert img.shape[:2] == (800, 1100)
    assert Path(trace.plot(tmp_path / "emotions.png", words)).is_file()
