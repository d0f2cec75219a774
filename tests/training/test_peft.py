"""LoRA through ``peft`` on both families: only the adapters train, and a saved adapter reloads onto a fresh
base model with the same outputs (the target module names are those of docs/training.md)."""

import peft
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from helpers import FAMILIES, micro_model, random_ids

# The linear layers of each block, and the two layers of every dense gate MLP (layers with predecessors only).
TARGET_MODULES = {
    "densemamba": ["in_proj", "x_proj", "dt_proj", "out_proj", "fc1", "fc2"],
    "denseretnet": ["q_proj", "k_proj", "hidden_proj", "o_proj", "fc1", "fc2"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trains_only_the_adapters_and_reloads(family, tmp_path):
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    base = micro_model(family)
    base.save_pretrained(base_dir)
    targets = [name for name, _ in base.named_modules() if name.rsplit(".", 1)[-1] in TARGET_MODULES[family]]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGET_MODULES[family], task_type="CAUSAL_LM")
    model = get_peft_model(base, config)

    # Every target got an adapter: block projections in every layer, gates in the dense layers.
    wrapped = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    assert [name.removeprefix("base_model.model.") for name in wrapped] == targets
    assert {name.rsplit(".", 1)[-1] for name in wrapped} == set(TARGET_MODULES[family])
    assert any(".dense_" in name and "lora_A" in name for name, _ in model.named_parameters())
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    assert len(trainable) == 2 * sum(hasattr(module, "lora_A") for module in model.modules())

    ids = random_ids(4, 12)
    with torch.no_grad():  # lora_B starts at zero: the wrapped model is the base model
        before = model.eval()(ids).logits
        with model.disable_adapter():
            assert torch.equal(before, model(ids).logits)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), f"frozen weight {name} changed"
        else:
            assert not torch.equal(p, adapters[name]), f"adapter weight {name} did not train"

    model.eval()
    with torch.no_grad():
        trained = model(ids).logits
    assert not torch.allclose(trained, before)

    # Save the adapter only; reload it onto a fresh base model loaded from its folder.
    model.save_pretrained(adapter_dir)
    assert (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "adapter_model.safetensors").is_file()
    saved = peft.utils.load_peft_weights(str(adapter_dir))
    assert saved and all("lora_" in key for key in saved)
    # torch's CPU matmul sums in another order when a weight requires grad, so the bit-for-bit
    # comparison reloads the adapter trainable, as it was trained; the inference-mode reload agrees to rounding.
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir, is_trainable=True)
    assert {name for name, p in reloaded.named_parameters() if p.requires_grad} == trainable
    inference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    assert not any(p.requires_grad for p in inference.parameters())
    with torch.no_grad():
        # fp32 tolerance: the loaded weights lie at other addresses, and oneDNN's matmul rounds by address
        torch.testing.assert_close(reloaded.eval()(ids).logits, trained)
        torch.testing.assert_close(inference.eval()(ids).logits, trained, atol=1e-6, rtol=1e-6)
        # Merged into the base weights, the adapter gives the same outputs up to rounding.
        merged = inference.merge_and_unload()
        assert type(merged) is type(model.get_base_model())
        torch.testing.assert_close(merged(ids).logits, trained, atol=1e-4, rtol=1e-4)
