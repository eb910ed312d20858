"""The vit recipe as merak sees it."""

from merak.recipe import RecipeSpec
from recipes.vision import data, loss

from . import model, parallel, schema

SPEC = RecipeSpec(
    name="vit",
    build_model=model.build_model,
    loss_fn=loss.cross_entropy_loss,
    prepare_data=data.prepare,
    load_dataset=data.load,
    check_layout=parallel.check_layout,
    check_data=data.check_data,
    model_schema=schema.VitModel,
    data_schema=schema.VitData,
    example_inputs=parallel.example_inputs,
    split_points=parallel.SPLIT_POINTS,
    tp_plan=parallel.tp_plan,
)
