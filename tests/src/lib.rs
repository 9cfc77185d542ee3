pub mod agent;
pub mod frames;
pub mod lab;
pub mod netns;
