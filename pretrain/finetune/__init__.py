"""Fine-tuning pretrained decoders on downstream tasks, with the pretraining engine and loop.

    deepspeed [--num_gpus N] --module pretrain.finetune --config CFG [overrides...]
    accelerate launch --multi_gpu --num_processes N -m pretrain.finetune --config CFG [overrides...]
    pretrain finetune --config CFG [overrides...]                      (one process)

Tasks (`finetune.task`):

- `classification`: GPT-1 style. Each example is EOS text [EOS pair] EOS (EOS starts a document
  in pretraining, so it starts one here too, as `pretrain generate` does) and a linear head reads
  the final hidden state of that last EOS. Labels (strings or integers) are numbered in sorted
  order of the training split. Validation reports accuracy and macro-F1.
- `sft`: EOS prompt completion EOS; the loss covers the completion and its EOS only. Validation
  reports the mean loss per completion token.

The model starts from `finetune.init`: a checkpoint of ours (a run or checkpoint directory) or a
Hugging Face Llama directory (with its SentencePiece `tokenizer.model` or a Hugging Face
`tokenizer.json`, whose special tokens its tokenizer_config.json names). Data is read with
`datasets` from local CSV/JSONL/parquet files or a Hub dataset, and tokenized with the
checkpoint's tokenizer; examples longer than `finetune.max_length` (default: the model's
max_seq_len) are truncated and counted. Checkpoints have the pretraining layout; an sft checkpoint
is a plain language model (`pretrain generate`, `export-hf`), a classification checkpoint is read by
`pretrain predict`. The final validation metrics go to RUN_DIR/eval_results.json.

    data.py        reading splits, labels, encoding examples, batches, the example order
    initial.py     the starting point (`finetune.init`): our checkpoint or a Hugging Face directory
    tasks.py       the loop's tasks: classification and sft (batches, evaluation, results)
    finetuning.py  `finetune(cfg)`: checks, process group, model, engine, then the loop
    predict.py     `pretrain predict`
"""

from pretrain.finetune.finetuning import finetune
from pretrain.finetune.predict import predict

__all__ = ["finetune", "predict"]
