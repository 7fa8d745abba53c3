"""Which image parts a request carries, and the field each came from (pure).

The server reads this list, gets each image's bytes (a `data:` URL here, an http(s) URL by its own
fetch where the operator allowed it), prepares them off the event loop with the model's
preprocessor, and hands the results back to `to_engine.chat_plan` keyed by the same field names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from compat import protocol as p


@dataclass(frozen=True, slots=True)
class ImageRef:
    param: str  # "messages[i].content[j]": the key the prepared image goes back under, and errors name
    url: str  # a data: URL or an http(s) URL, as sent


def image_refs(messages: Sequence[p.Message] | object, param: str = "messages") -> list[ImageRef]:
    """The image parts of the user messages, in prompt order (others are refused by to_engine)."""
    if not isinstance(messages, list):
        return []
    refs = []
    for i, message in enumerate(messages):
        if isinstance(message, p.UserMessage) and isinstance(message.content, list):
            refs.extend(ImageRef(f"{param}[{i}].content[{j}]", part.image_url.url)
                        for j, part in enumerate(message.content) if isinstance(part, p.ImagePart))
    return refs


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"
