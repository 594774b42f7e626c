"""Images in: content parts, safe fetching and decoding, the model's own processor, placeholder spans."""
