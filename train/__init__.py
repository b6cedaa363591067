"""Jobs that fit things to a model, and what they read: pretraining the shipped model
(`pretrain`, on the synthetic tasks of `data` with the word-level `tokenizer`), LycheeDecode's
head gates (`gates`, `hardkuma`, `passkey`) and DELTA/Kascade calibration (`calibrate`).

Nothing is imported here, so `from sparsejax.train import data` loads neither Optax nor Orbax.
"""
