"""The codecs: each decodes a batch of JPEGs (or one image) on one device, nothing about scheduling or
processes."""
