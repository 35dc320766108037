"""The built-in reward scorers, one module per scorer family, each implementing
:class:`flowforge.rewards.base.RewardScorer`:

================  ===================================================================================
``digit``         embedded-default digit reward and DigitEval (classifiers from :mod:`flowforge.demo`)
``jpeg``          DDPO's JPEG (in)compressibility, CPU only
``clip_common``   shared CLIP pieces: option checks, weak model cache, torch preprocessing, embeddings
``pickscore``     PickScore (transformers CLIP-H)
``clip_score``    CLIP score: cosine, CLIPScore, flow_grpo's scaled logit
``aesthetic``     LAION improved-aesthetic-predictor head on CLIP-L/14 image embeddings
``hps``           HPSv2 (optional ``open_clip``)
``vlm_pointwise`` one ledgered chat completion per sample (the group judge's transport, ledger, retry rules)
``unified_reward`` UnifiedReward's pointwise 1-5 image score through an OpenAI-compatible server
``vqa_score``     VQAScore: P("Yes") from a local VLM or from a server's ``top_logprobs``
``edit_score``    EditScore: an image edit scored from the source image, the instruction and the edited image
================  ===================================================================================

Scorers are looked up by name through :mod:`flowforge.rewards.registry`; this package imports nothing itself, so
importing one scorer module does not load the others' dependencies.
"""
