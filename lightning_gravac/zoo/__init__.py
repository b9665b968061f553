"""Models and data the recipes train."""

from lightning_gravac.missing_data import MissingData
from lightning_gravac.zoo.cifar import CIFARDataModule, SyntheticImages
from lightning_gravac.zoo.gpt import ByteGPT, TextDataModule
from lightning_gravac.zoo.language import LSTMLanguageModel, PTBDataModule
from lightning_gravac.zoo.synthetic import (
    BagOfWordsRegression,
    TeacherDataModule,
    TeacherRegression,
    bag_of_words_dataset,
    teacher_dataset,
)
from lightning_gravac.zoo.tabular import TabularClassifier, read_table
from lightning_gravac.zoo.vision import ImageClassifier

__all__ = [
    "BagOfWordsRegression",
    "ByteGPT",
    "CIFARDataModule",
    "ImageClassifier",
    "LSTMLanguageModel",
    "MissingData",
    "PTBDataModule",
    "SyntheticImages",
    "TabularClassifier",
    "TeacherDataModule",
    "TeacherRegression",
    "TextDataModule",
    "bag_of_words_dataset",
    "read_table",
    "teacher_dataset",
]
