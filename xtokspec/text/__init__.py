"""The text layer: one tokenizer seen as bytes (`codec`), two tokenizations of one text kept in step (`bridge`),
and chat templates rendered for both models (`chat`). No model, no torch tensors of a model's."""
