"""Audio input for the speech-to-text doors (`/v1/audio/transcriptions`, Whisper): an upload's bytes ->
float32 mono samples at the model's rate under the server's limits (`decode.py`), and long audio -> chunks
of at most 30 s cut at quiet moments (`chunks.py`). Synchronous and socket-free; a door runs `decode_audio`
in a thread, off the event loop."""

from frontend.audio.chunks import chunk_bounds, split_audio
from frontend.audio.decode import decode_audio
from frontend.audio.limits import AudioLimits, AudioTooLargeError, InvalidAudioError

__all__ = [
    "AudioLimits",
    "AudioTooLargeError",
    "InvalidAudioError",
    "chunk_bounds",
    "decode_audio",
    "split_audio",
]
