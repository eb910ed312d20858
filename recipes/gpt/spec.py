"""The gpt recipe as merak sees it."""

from merak.recipe import RecipeSpec

from . import data, model, parallel, schema

SPEC = RecipeSpec(
    name="gpt",
    build_model=model.build_model,
    loss_fn=model.causal_lm_loss,
    prepare_data=data.prepare,
    load_dataset=data.load,
    check_layout=parallel.check_layout,
    check_data=data.check_data,
    model_schema=schema.GptModel,
    data_schema=schema.GptData,
    tokens_per_sample=model.tokens_per_sample,
    example_inputs=parallel.example_inputs,
    input_names=parallel.INPUT_NAMES,
    split_points=parallel.SPLIT_POINTS,
    tp_plan=parallel.TP_PLAN,
)
