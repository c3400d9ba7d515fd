"""Workloads written elsewhere, trained by reprotrain unchanged: their models, data and collate
functions are what a user brings, not code shaped for reprotrain.

word_language_model  PyTorch's word-language-model example (RNNModel, TransformerModel), verbatim
corpus               a seeded Markov-chain text for language modelling, batchified into streams
regression           scikit-learn's diabetes data and a tutorial's regression MLP
hf                   token sequences of varying length, their padding collate, a BERT classifier
"""
