"""Models and data the recipes train."""

from lightning_gravac.zoo.synthetic import TeacherDataModule, TeacherRegression, teacher_dataset

__all__ = ["TeacherDataModule", "TeacherRegression", "teacher_dataset"]
