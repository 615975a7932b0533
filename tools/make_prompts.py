"""Writes llmaccel/bench/data/chat_prompts.jsonl: the built-in benchmark prompt set.

Each prompt gets a target output length drawn once (seeded) from a log-normal spread: most answers
are short, a long tail reaches 512 tokens, as in chat traffic. Run again only to change the set.
"""

import json
import random
from pathlib import Path

EN = """What is the capital of France?
Explain the difference between a list and a tuple in Python.
Write a haiku about the first snow of winter.
How do I make a good cup of pour-over coffee?
Summarize the plot of Romeo and Juliet in three sentences.
What are three tips for getting better sleep?
Give me a recipe for a quick vegetarian pasta dinner.
Why is the sky blue?
Translate "Where is the train station?" into Spanish and French.
Write a short motivational message for someone starting a new job.
What is the difference between weather and climate?
Explain recursion to a ten-year-old.
List five fun things to do on a rainy weekend.
How does a refrigerator keep food cold?
Write a polite email asking my manager for a day off next Friday.
What are the main causes of inflation?
Suggest a name for a friendly golden retriever puppy.
How many planets are in the solar system, and which is the largest?
Write a limerick about a cat who loves to code.
What should I pack for a three-day hiking trip?
Explain what a hash table is and why lookups are fast.
Give me a short workout I can do at home without equipment.
How do vaccines train the immune system?
What is the Pythagorean theorem? Give an example.
Write a two-paragraph story about a robot learning to paint.
What is the best way to learn a new language as an adult?
Explain the difference between TCP and UDP.
How do I politely decline an invitation to a party?
Describe the water cycle in simple terms.
What are the pros and cons of working from home?
Write a SQL query that finds the ten customers with the highest total order value.
What is photosynthesis?
Give me three ideas for a birthday gift for my mother who likes gardening.
How do I reverse a string in JavaScript?
Why do leaves change color in autumn?
Write a product description for a reusable water bottle.
What is the difference between an LLC and a corporation?
Explain how a bill becomes a law in the United States.
What does a CPU cache do?
Write a thank-you note to a teacher at the end of the school year.
How can I reduce my household's plastic waste?
Explain the rules of chess in a short paragraph.
What is machine learning, in one paragraph?
Give me a packing checklist for a business trip.
How do I calculate compound interest? Show the formula.
Write a short poem about the ocean at night.
What is the difference between affect and effect?
Explain what Docker containers are and why developers use them.
How do noise-cancelling headphones work?
Suggest a weekly meal plan for a busy family of four.
What were the main causes of World War I?
Write a Python function that checks whether a number is prime.
How should I prepare for a job interview?
Why do we have leap years?
Explain the concept of supply and demand.
Write a bedtime story about a small dragon who is afraid of the dark.
What are black holes?
Give me tips for public speaking when I am nervous.
Explain the difference between RAM and storage.
What is a good way to start journaling?
Write a cover letter opening paragraph for a data analyst position.
How does GPS determine my location?
What are the health benefits of walking every day?
Explain big-O notation with examples.
How do I care for a succulent plant?
Write a short dialogue between a barista and a customer who cannot decide what to order.
What is the greenhouse effect?
Compare electric cars and gasoline cars in terms of cost and environment.
How do I center a div in CSS?
What is the meaning of the idiom "break the ice"?
Write a tweet announcing the launch of a new bakery.
Why do cats purr?
Explain what an API is to a non-technical person.
What is the difference between a virus and a bacterium?
Plan a one-day itinerary for a first visit to Rome.
Write a regular expression that matches an email address and explain it.
How do airplanes stay in the air?
Give me five interesting facts about octopuses.
What is the stock market and how does it work?
Write a short speech for a friend's wedding toast.
What is the difference between git merge and git rebase?
How can I improve my credit score?
Explain quantum computing in simple words.
What are some good habits for staying productive?
Write an outline for an essay on the impact of social media on teenagers.
How does the heart pump blood through the body?
What is the difference between a simile and a metaphor?
Recommend three classic novels and say why each is worth reading.
Explain how HTTPS keeps my data safe.
What is a balanced diet?
Write a bash one-liner that counts the lines in all .py files in a directory.
Why is the ocean salty?
Explain the difference between mean, median and mode.
How do I make friends in a new city?
Write a short horror story in exactly five sentences.
What is blockchain technology?
How do I fix a leaking faucet?
Describe the life cycle of a butterfly.
What is the role of mitochondria in a cell?
Write a haiku about a city at sunrise.
Explain how compound words are formed in German.
Give me a study schedule for a final exam in two weeks.
Why is sleep important for memory?
Write a Python class representing a bank account with deposit and withdraw methods.
What causes earthquakes?
How do solar panels generate electricity?
What are the main differences between Python and Java?
Write a short review of an imaginary restaurant that serves only soup.
How should I negotiate a higher salary?
What is the theory of evolution?
Explain what a neural network is.
Give me a list of ten healthy snacks.
What is inflation-adjusted return on an investment?
Write a summary of the benefits of meditation.
How does a search engine rank web pages?
What is the difference between empathy and sympathy?
Write a children's rhyme about brushing teeth.
Explain the French Revolution in a few paragraphs.
How can I keep my houseplants alive while on vacation?
What are prime numbers? List the first fifteen.
Write a story about a time traveler who visits a library in the year 3000.
How does caching make web applications faster?
Explain the difference between "its" and "it's".
What are some strategies to manage stress at work?
Write a detailed guide to planning a vegetable garden for beginners.
Describe how a compiler turns source code into a program.
What is the Turing test?
Write an email to a customer apologizing for a delayed shipment.
Explain how to solve a quadratic equation.
What are the benefits of reading fiction?
Give me a packing list for a beach holiday with kids.
Write a short essay about the importance of friendship.
How do tides work?
What are microservices, and when should a team avoid them?
Write a Python script that reads a CSV file and prints the average of one column.
How does the immune system fight a cold?
What is the difference between a crocodile and an alligator?
Write a short fable with a moral about patience.
Explain what a mortgage is and how interest affects it.
Tell me a joke about programmers.""".strip().splitlines()

ZH = """法国的首都是哪里？
请用三句话介绍一下长城。
写一首关于秋天的五言绝句。
如何提高学习效率？给我五个建议。
解释一下什么是人工智能。
为什么天空是蓝色的？
请推荐三本适合初学者的编程书。
怎样做一道简单的西红柿炒鸡蛋？
请写一封给老师的感谢信。
什么是区块链技术？用通俗的语言解释。
如何保持健康的作息习惯？
请翻译这句话成英文：今天的天气非常好，我们去公园散步吧。
介绍一下中国的四大发明。
写一个关于小猫学会钓鱼的童话故事。
什么是机器学习？它和深度学习有什么区别？
给我一个三天的北京旅游行程安排。
如何缓解工作压力？
请解释一下光合作用的过程。
用Python写一个计算斐波那契数列的函数。
为什么要多喝水？
请简要介绍一下唐朝的历史。
怎样才能写好一篇议论文？
介绍一下太阳系的八大行星。
请写一段关于春节的描述。
如何学好英语口语？
什么是通货膨胀？它对普通人有什么影响？
给我讲一个关于诚信的小故事。
请列出十种健康的早餐食物。
解释一下什么是云计算。
怎样照顾家里的绿植？
请写一首关于月亮的现代诗。
如何准备一次成功的面试？
介绍一下京剧的基本知识。
为什么会有四季变化？
请用简单的话解释相对论。
写一篇关于环境保护的短文。
如何培养孩子的阅读习惯？
什么是大语言模型？它是如何工作的？
请介绍一下中国的传统节日中秋节。
怎样做好时间管理？
请写一个关于勇气的寓言故事。
解释一下数据库中的索引有什么作用。
如何挑选一台适合自己的笔记本电脑？
介绍一下熊猫的生活习性。
请写一封道歉信，因为我错过了朋友的生日聚会。
为什么运动对身体有好处？
请总结一下《西游记》的主要情节。
如何制定一个合理的理财计划？
什么是量子计算？
写一段描写雨后城市的文字。
给初学者介绍一下围棋的基本规则。
如何提高写作水平？
请解释一下什么是操作系统。
介绍一下长江和黄河的区别。
请写一篇关于友谊的作文，不少于三段。
怎样才能睡个好觉？
请用中文解释什么是递归。
介绍一下茶文化的历史。
如何与同事有效沟通？
请写一首关于家乡的诗。""".strip().splitlines()


def main() -> None:
    rng = random.Random(20261129)
    rows = []
    for lang, prompts in (("en", EN), ("zh", ZH)):
        for text in prompts:
            # log-normal around a median of ~96 tokens, clipped to [16, 512]
            target = int(min(512, max(16, rng.lognormvariate(4.55, 0.8))))
            rows.append({"prompt": text, "lang": lang, "output_len": target})
    rng.shuffle(rows)
    out = Path(__file__).resolve().parents[1] / "llmaccel" / "bench" / "data" / "chat_prompts.jsonl"
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    lens = sorted(r["output_len"] for r in rows)
    print(f"{len(rows)} prompts ({len(EN)} en, {len(ZH)} zh) -> {out}; output_len median {lens[len(lens)//2]}, "
          f"mean {sum(lens)/len(lens):.0f}, max {lens[-1]}")


if __name__ == "__main__":
    main()
