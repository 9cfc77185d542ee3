pub mod apiserver;
pub mod agent;
pub mod flows;
pub mod frames;
pub mod halab;
pub mod kubelab;
pub mod lab;
pub mod netns;
