"""The training data: where images and captions come from (a local folder, kohya's folders, a hub data set, the
bundled sets), their buckets and crops, which samples make up each batch, the encodings and their cache, class images
(prior preservation), pair sequences and this rank's micro-batch."""
