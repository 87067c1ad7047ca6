"""Stock-shaped training scripts for the conformance suite (``tests/compat/test_scripts.py``).

Each module is written like one of transformers' examples (``run_clm.py``, ``run_mlm.py``,
``run_glue.py``) or task guides (token classification, question answering, summarization /
translation, callbacks): ``HfArgumentParser`` over ``ModelArguments`` / ``DataTrainingArguments``
/ ``TrainingArguments``, last-checkpoint detection, tokenization with ``Dataset.map``, the task's
collator, ``train(resume_from_checkpoint=...)``, ``save_model``, ``log_metrics`` /
``save_metrics`` / ``save_state``, ``evaluate`` and ``predict``.

The only thing that differs between a run under transformers and one under ``trainer_runtime`` is
where the Trainer API comes from: every script is ``main(argv, api)`` and reads ``Trainer``,
``TrainingArguments``, ``get_last_checkpoint``, ... from ``api`` (:mod:`.common`), the stand-in
for the ``from transformers import ...`` line of the original. Models and data are tiny and built
in memory (``tests/transformers/models.py``): nothing is downloaded.
"""
