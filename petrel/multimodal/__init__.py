"""Images in prompts: decoding and checking media (media.py), the per-request data the engine carries (inputs.py),
and each model family's processor, which turns a prompt and its images into token ids and encoder inputs."""
