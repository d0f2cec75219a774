"""transformers' own common model tests, run against both families as transformers runs them against its Mamba.

transformers tests every model it ships with the same mixins: ``ModelTesterMixin`` (save/load, init, outputs,
hidden states, embeddings resizing, training, gradient checkpointing, batching, dtypes, ...), ``ConfigTester``,
``TrainingTesterMixin`` (a tiny model overfits a fixed batch) and ``GenerationTesterMixin``. Here they run on the
installed transformers release's own copy of them, fetched at run time (``tests/models/transformers_release_tests.py``):
the sdist of exactly that release is downloaded from PyPI with pip on the first run and unpacked into
``~/.cache/hf_densessm/transformers-tests/<version>/``; later runs reuse it. Nothing of transformers is kept in this
repository.

The tester classes follow transformers' ``tests/models/mamba/test_modeling_mamba.py`` (``MambaModelTester``,
``MambaModelTest``): a tiny config (hidden size 32, 2 layers, vocabulary 99, batch 14 of 7 tokens), its flags for
its reasons, and its model-specific checks (base model, LM head, a prefix plus one cached token against the whole
sequence, backpropagation through the LM head and through a forward that continues a cache). Every skip of ours
says why in its flag or decorator (:class:`DenseSSMModelTestBase`); the other skips are the mixins' own conditions
(no accelerator, no Flash Attention, no RoPE, ...), listed in docs/testing.md.

**What transformers' sdist lacks.** transformers 5.17 to 5.24 ship ``tests/test_modeling_common.py``,
``tests/test_configuration_common.py`` and ``tests/test_training_mixin.py`` in their sdist, but not
``tests/generation/test_utils.py`` (``GenerationTesterMixin``), ``tests/exporters/test_export.py``
(``ExportTesterMixin``) nor ``tests/utils/test_configuration_utils.py``. Those suites are then not run, and
``test_generation_tester_mixin``, ``test_export_tester_mixin`` and ``test_config_arguments_init`` skip, saying so.
Setting ``HF_DENSESSM_TRANSFORMERS_SOURCE`` to a transformers source tree of the installed release (a checkout of
its tag) runs the complete suites from it.

**Offline.** When the sdist cannot be downloaded (no network), this module skips with the reason. With
``HF_DENSESSM_REQUIRE_TRANSFORMERS_TESTS=1`` (meant for CI) it fails instead. See docs/testing.md.
"""

import unittest
from unittest import mock

import torch
from transformers.models.auto import modeling_auto

import transformers_release_tests
from hf_densessm import (
    DenseMambaConfig,
    DenseMambaForCausalLM,
    DenseMambaForSequenceClassification,
    DenseMambaModel,
    DenseRetNetConfig,
    DenseRetNetForCausalLM,
    DenseRetNetForSequenceClassification,
    DenseRetNetModel,
)
from hf_densessm.modeling.cache import DenseSSMCache
from hf_densessm.modeling.cache_names import output_cache
from helpers import enable_checkpointing

COMMON = transformers_release_tests.load_or_skip()
ids_tensor = COMMON.ids_tensor

#: Where transformers' mixins look a model class up by name (base model, causal LM, sequence classification), and
#: the classes of each family that belong there: while a test of this module runs, each family is listed as if it
#: were one of transformers' models, so that the mixins treat ours as they treat its Mamba (e.g. ``test_training``
#: skips base models, which have no loss; ``_prepare_for_class`` makes labels for the heads).
NAME_MAPPINGS = {
    "MODEL_MAPPING_NAMES": {"densemamba": "DenseMambaModel", "denseretnet": "DenseRetNetModel"},
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": {
        "densemamba": "DenseMambaForCausalLM", "denseretnet": "DenseRetNetForCausalLM"
    },
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": {
        "densemamba": "DenseMambaForSequenceClassification",
        "denseretnet": "DenseRetNetForSequenceClassification",
    },
}


class DenseSSMModelTester:
    """Tiny configs and inputs for one family, and the model-specific checks, as transformers' ``MambaModelTester``.

    The dense connection is on (``dense_layers=2``; with the 2 layers transformers' tests allow, layer 1 fuses
    layer 0's features).
    """

    def __init__(
        self,
        parent,
        family,
        batch_size=14,
        seq_length=7,
        is_training=True,
        use_labels=True,
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        dense_layers=2,
        type_sequence_label_size=2,
        num_labels=3,
    ):
        self.parent = parent
        self.family = family
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_labels = use_labels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.dense_layers = dense_layers
        self.type_sequence_label_size = type_sequence_label_size
        self.num_labels = num_labels
        self.bos_token_id = vocab_size - 1
        self.eos_token_id = vocab_size - 1
        self.pad_token_id = vocab_size - 1
        classes = {
            "densemamba": (
                DenseMambaConfig, DenseMambaModel, DenseMambaForCausalLM, DenseMambaForSequenceClassification
            ),
            "denseretnet": (
                DenseRetNetConfig, DenseRetNetModel, DenseRetNetForCausalLM, DenseRetNetForSequenceClassification
            ),
        }[family]
        # TrainingTesterMixin trains `causal_lm_class`, as it does transformers' own causal LMs.
        self.config_class, self.base_model_class, self.causal_lm_class, self.sequence_classification_class = classes
        self.num_attention_heads = 2 if family == "denseretnet" else None

    def get_config(self):
        """The tiny config of this family (``num_labels`` for the sequence-classification head)."""
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            dense_layers=self.dense_layers,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            num_labels=self.num_labels,
            use_cache=True,
        )
        if self.family == "densemamba":
            return DenseMambaConfig(state_size=16, **common)
        return DenseRetNetConfig(num_attention_heads=self.num_attention_heads, query_key_dim=16, **common)

    def prepare_config_and_inputs(self):
        """``(config, input_ids, attention_mask, sequence_labels, token_labels)``, as ``MambaModelTester``."""
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.ones_like(input_ids)
        sequence_labels = token_labels = None
        if self.use_labels:
            sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
        return self.get_config(), input_ids, attention_mask, sequence_labels, token_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask, *_ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}

    def create_and_check_base_model(self, config, input_ids, *args):
        """The base model's last hidden state and per-layer hidden states have the expected shapes."""
        model = self.base_model_class(config).eval()
        result = model(input_ids, output_hidden_states=True)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))
        self.parent.assertEqual(len(result.hidden_states), config.num_hidden_layers + 1)

    def create_and_check_causal_lm(self, config, input_ids, *args):
        """The LM head gives a scalar loss and logits over the vocabulary."""
        model = self.causal_lm_class(config).eval()
        result = model(input_ids, labels=input_ids)
        self.parent.assertEqual(result.loss.shape, ())
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))

    def create_and_check_state_equivalency(self, config, input_ids, *args):
        """The whole sequence in one call equals all but its last token, then that token continuing the cache."""
        model = self.base_model_class(config).eval()
        with torch.no_grad():
            whole = model(input_ids).last_hidden_state
            first = model(input_ids[:, :-1], use_cache=True)
            second = model(input_ids[:, -1:], use_cache=True, cache=output_cache(first))
        torch.testing.assert_close(
            torch.cat([first.last_hidden_state, second.last_hidden_state], dim=1), whole, atol=1e-5, rtol=1e-5
        )

    def create_and_check_cached_forward_and_backwards(self, config, input_ids, *args):
        """A multi-token forward that continues a cache backpropagates (``MambaModelTester``'s
        ``create_and_check_mamba_cached_slow_forward_and_backwards``: training on a prefix's state)."""
        model = self.base_model_class(config)
        with torch.no_grad():
            cache = output_cache(model(input_ids[:, :3], use_cache=True))
        outputs = model(input_ids[:, 3:], use_cache=True, cache=cache).last_hidden_state
        loss = torch.log1p(torch.abs(outputs.sum()))
        self.parent.assertEqual(loss.shape, ())
        self.parent.assertEqual(outputs.shape, (self.batch_size, self.seq_length - 3, self.hidden_size))
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        self.parent.assertTrue(all(g is not None and torch.isfinite(g).all() for g in grads))

    def create_and_check_lm_head_forward_and_backwards(self, config, input_ids, *args, gradient_checkpointing=False):
        """The LM head's loss backpropagates, with or without gradient checkpointing."""
        model = self.causal_lm_class(config)
        if gradient_checkpointing:
            enable_checkpointing(model)
        result = model(input_ids, labels=input_ids)
        self.parent.assertEqual(result.loss.shape, ())
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        result.loss.backward()


class DenseSSMModelTestBase(
    COMMON.ModelTesterMixin, COMMON.GenerationTesterMixin, COMMON.TrainingTesterMixin
):
    """What both families' test classes share: transformers' mixins, the flags and skips (each with its reason) and
    the checks of ``MambaModelTest``. A subclass sets :attr:`family` and ``all_model_classes``.

    Where this differs from ``MambaModelTest``: ``test_missing_keys`` stays on (Mamba turns it off; ours pass it);
    ``test_can_init_all_missing_weights`` is turned on (below); ``PipelineTesterMixin`` is not mixed in (it needs
    transformers' ``tests/pipelines/``, not in the sdist, and tiny models from the Hub); Mamba's
    ``test_dtype_mismatch_handled_in_cache`` is not mirrored (it builds Mamba's own pre-allocated cache, where ours
    allocates its states on first use in the model's dtype).
    """

    family = None

    # A recurrent model: no attention weights to return (MambaModelTest sets it for the same reason).
    has_attentions = False
    # transformers runs `test_can_init_all_missing_weights` only for models whose config file carries a copyright
    # year from 2023 on, or with this flag (ours carry no such header); releases without the flag (5.17) skip it.
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        # Tiny models: one thread, as the OpenMP hand-offs of a second one cost more than they save at this size.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self.addCleanup(torch.set_num_threads, threads)
        self.model_tester = DenseSSMModelTester(self, self.family)
        self.config_tester = COMMON.ConfigTester(
            self, config_class=self.model_tester.config_class, hidden_size=37,
            common_properties=["hidden_size", "num_hidden_layers"],
        )
        for mapping, names in NAME_MAPPINGS.items():
            patch = mock.patch.dict(getattr(modeling_auto, mapping), {self.family: names[self.family]})
            patch.start()
            self.addCleanup(patch.stop)

    def test_mixins_see_our_classes(self):
        """transformers' mixins find our classes where they look for its own (:data:`NAME_MAPPINGS`): the heads get
        labels from ``_prepare_for_class``, and the base model is known as one (``test_training`` skips it)."""
        _, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        tester = self.model_tester
        lm_inputs = self._prepare_for_class(inputs, tester.causal_lm_class, return_labels=True)
        self.assertEqual(lm_inputs["labels"].shape, (tester.batch_size, tester.seq_length))
        classifier_inputs = self._prepare_for_class(inputs, tester.sequence_classification_class, return_labels=True)
        self.assertEqual(classifier_inputs["labels"].shape, (tester.batch_size,))
        self.assertIn(tester.base_model_class.__name__, modeling_auto.MODEL_MAPPING_NAMES.values())

    # ---- the config ----

    def test_config(self):
        """``ConfigTester.run_common_tests``, less ``check_config_arguments_init`` when its data is not shipped
        (``test_config_arguments_init``)."""
        if "utils.test_configuration_utils" in COMMON.not_shipped:
            self.config_tester.check_config_arguments_init = lambda: None
        self.config_tester.run_common_tests()

    def test_config_arguments_init(self):
        """``ConfigTester.check_config_arguments_init``: every common config keyword is kept."""
        if "utils.test_configuration_utils" in COMMON.not_shipped:
            self.skipTest(f"transformers {_release()}'s sdist does not ship "
                          "tests/utils/test_configuration_utils.py (config_common_kwargs)")
        self.config_tester.check_config_arguments_init()

    # ---- the suites transformers' sdist may lack ----

    def test_generation_tester_mixin(self):
        """GenerationTesterMixin's tests are part of this class (they are, where the module is shipped)."""
        if "generation.test_utils" in COMMON.not_shipped:
            self.skipTest(f"transformers {_release()}'s sdist does not ship tests/generation/test_utils.py: "
                          "GenerationTesterMixin's tests are not run (see docs/testing.md)")
        self.assertTrue(any(name.startswith("test_") for name in vars(COMMON.GenerationTesterMixin)))

    def test_export_tester_mixin(self):
        """ExportTesterMixin's tests are part of this class (they are, where the module is shipped)."""
        if "exporters.test_export" in COMMON.not_shipped:
            self.skipTest(f"transformers {_release()}'s sdist does not ship tests/exporters/test_export.py: "
                          "ExportTesterMixin's tests are not run (see docs/testing.md)")
        self.assertTrue(any(name.startswith("test_") for name in vars(COMMON.ExportTesterMixin)))

    # ---- MambaModelTest's model-specific checks ----

    def test_base_model(self):
        self.model_tester.create_and_check_base_model(*self.model_tester.prepare_config_and_inputs())

    def test_lm_head_model(self):
        self.model_tester.create_and_check_causal_lm(*self.model_tester.prepare_config_and_inputs())

    def test_state_equivalency(self):
        self.model_tester.create_and_check_state_equivalency(*self.model_tester.prepare_config_and_inputs())

    def test_cached_forward_and_backwards(self):
        self.model_tester.create_and_check_cached_forward_and_backwards(*self.model_tester.prepare_config_and_inputs())

    def test_lm_head_forward_and_backwards(self):
        self.model_tester.create_and_check_lm_head_forward_and_backwards(*self.model_tester.prepare_config_and_inputs())

    def test_lm_head_forward_and_backwards_gradient_checkpointing(self):
        self.model_tester.create_and_check_lm_head_forward_and_backwards(
            *self.model_tester.prepare_config_and_inputs(), gradient_checkpointing=True
        )

    def test_cache_is_densessm_cache(self):
        """The cache a forward returns is the package's (transformers' ``DynamicCache`` of linear-attention layers,
        plus a token count), one layer per block, counting the positions given."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = self.model_tester.causal_lm_class(config).eval()
        with torch.no_grad():
            cache = output_cache(model(**inputs, use_cache=True))
        self.assertIsInstance(cache, DenseSSMCache)
        self.assertEqual(len(cache.layers), config.num_hidden_layers)
        self.assertEqual(cache.get_seq_length(), self.model_tester.seq_length)



def _release():
    """The installed transformers release."""
    import transformers

    return transformers.__version__


class DenseMambaModelTest(DenseSSMModelTestBase, unittest.TestCase):
    """transformers' common tests on DenseMamba (base model, causal LM, sequence classification)."""

    family = "densemamba"
    all_model_classes = (DenseMambaModel, DenseMambaForCausalLM, DenseMambaForSequenceClassification)


class DenseRetNetModelTest(DenseSSMModelTestBase, unittest.TestCase):
    """transformers' common tests on DenseRetNet (base model, causal LM, sequence classification)."""

    family = "denseretnet"
    all_model_classes = (DenseRetNetModel, DenseRetNetForCausalLM, DenseRetNetForSequenceClassification)
