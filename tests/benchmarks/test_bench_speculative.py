"""benchmarks/bench_speculative.py runs end to end (a micro model with a small BPE tokenizer, a few tokens): every
method gives plain greedy's tokens."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import bench_speculative  # noqa: E402
import corpus  # noqa: E402

from hf_densessm import DenseMambaConfig, DenseMambaForCausalLM  # noqa: E402


def test_bench_speculative_runs(tmp_path, capsys):
    tokenizer = corpus.train_tokenizer([(corpus.stdlib_root() / "textwrap.py").read_text()], 300)
    torch.manual_seed(0)
    config = DenseMambaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4, state_size=8)
    DenseMambaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    results = bench_speculative.main([
        "--model-dir", str(tmp_path), "--prompt-tokens", "48", "--new-tokens", "8", "--repeats", "1", "--warmup", "0",
        "--lookup-tokens", "2", "5",
    ])
    assert len(results) == 4 and all(row["same_tokens"] for row in results.values())
    out = capsys.readouterr().out
    assert "| plain greedy |" in out and "| prompt lookup (2) |" in out and "| prompt lookup (5) |" in out
