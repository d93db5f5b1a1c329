#include "ref64.h"
int main(void) { return 0; }
