"""How a batch is split between the GPU decoders and the CPU (its workers or threads): the shares, the
steering rule, which decoders a pipeline gets."""
