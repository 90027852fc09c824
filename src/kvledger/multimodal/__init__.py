"""Images in: a request's image parts read and decoded with limits (``media.py``), turned into pixel
values, image-token runs and content hashes by the family's own transformers processor
(``processor.py``), carried as ``MultiModalInputs`` (``inputs.py``), and encoded by the model's vision
tower and projector in the engine process (``encoder.py``), whose embeddings replace the image
tokens' in the prefill (``embeds.py``: held per request until the image's last token is prefilled)."""

from .inputs import ImageItem, MultiModalInputs

__all__ = ["ImageItem", "MultiModalInputs"]
