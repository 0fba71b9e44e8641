"""The task set of the speculation benchmark: grounded prompts, whose answers copy
long spans of a text given in the prompt (what prompt lookup drafts from), and open chat,
whose answers copy nothing (what speculation must not slow down).

Four grounded kinds, six tasks each, every given text 60-200 words of made-up office
material (tickets, emails, notes, policies, short functions); eight open-chat prompts. Each
is one plain user message with no `format` or system prompt, so llama.cpp can be given the
very same prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUNDED_KINDS = ("summarize", "extract", "rewrite", "code")
KINDS = (*GROUNDED_KINDS, "open")


@dataclass(frozen=True)
class Task:
    name: str
    kind: str
    instruction: str
    given: str = ""  # the text the answer works on; empty for open chat

    @property
    def messages(self) -> list[dict]:
        content = f"{self.instruction}\n\n{self.given}" if self.given else self.instruction
        return [{"role": "user", "content": content}]


SUMMARIZE = [
    Task(
        "summarize-ticket",
        "summarize",
        "Summarize this ticket in two sentences:",
        "Ticket #4821, opened by Maria Lindqvist (Finance), priority normal. Since Monday my "
        "two external monitors flicker every few minutes when the laptop is in the docking "
        "station on desk 3.14. The flicker lasts about two seconds and sometimes the second "
        "monitor goes black until I unplug the dock and plug it in again. It does not happen "
        "when I use the laptop alone or when I work from home with my own screen. I already "
        "tried another cable from the supply cupboard and restarted the laptop twice. A "
        "colleague at desk 3.15 has the same dock model and no problem. I need both screens "
        "for the month-end close, which starts on Thursday, so I would be grateful if someone "
        "could look at it before then.",
    ),
    Task(
        "summarize-notes",
        "summarize",
        "Summarize these meeting notes in three bullet points:",
        "Weekly operations meeting, 12 March. Present: Tom Becker, Aisha Khan, Lukas Meyer, "
        "Priya Nair. The new coffee machine on the second floor is installed but the water "
        "filter has not arrived; Lukas will chase the supplier by Friday. The printer fleet "
        "contract ends in June, and Aisha collected three offers; the cheapest one does not "
        "include on-site repair, so the team agreed to compare total cost over three years "
        "before deciding. Priya reported that 14 laptops are older than five years and "
        "proposed replacing six of them this quarter and the rest in the autumn. Tom asked "
        "everyone to book meeting rooms through the new calendar system from next Monday, "
        "because paper lists on the doors will be removed. Next meeting on 19 March.",
    ),
    Task(
        "summarize-incident",
        "summarize",
        "Summarize this incident report for a manager in two or three sentences:",
        "Incident report, email service, 7 May. At 09:12 staff started reporting that "
        "outgoing emails stayed in the outbox. The on-call engineer, Daniel Okafor, found that "
        "the mail relay had run out of disk space because a log file had grown to 40 GB after "
        "a logging level was left on debug during last week's maintenance. He deleted the old "
        "logs, set the level back to normal and restarted the relay at 10:05. All queued "
        "messages were delivered by 10:20; no email was lost. To prevent a repeat, the team "
        "added a disk space alert at 80 percent and a weekly log rotation job. The "
        "maintenance checklist now includes a step to reset logging levels.",
    ),
    Task(
        "summarize-policy",
        "summarize",
        "Summarize this policy in plain words for new employees:",
        "Travel expense policy, section 4. Employees travelling on company business may claim "
        "the actual cost of public transport, economy class flights booked at least 14 days "
        "ahead, and hotel rooms up to 120 euros per night, or 160 euros in capital cities. "
        "Meals are covered by a daily allowance of 35 euros; receipts for meals are not "
        "needed. Taxis are refunded only when no public transport is available or when the "
        "trip starts or ends between 22:00 and 06:00. Claims must be submitted in the expense "
        "tool within 30 days of the return, with a scan of every receipt except for meals. "
        "Claims submitted later need approval from the department head.",
    ),
    Task(
        "summarize-complaint",
        "summarize",
        "Summarize this customer email in one short paragraph for the support team:",
        "Hello, I am writing about order 88213, which I placed on 2 February for twelve "
        "office chairs for our new branch in Leeds. The confirmation said delivery within ten "
        "working days, but the chairs arrived on 3 March, almost four weeks late, and only "
        "after I called your hotline three times. Two of the chairs have a broken height "
        "lever and one arrived with a torn seat. Your driver would not wait while we checked "
        "the boxes. We would like the three damaged chairs replaced and a partial refund of "
        "the delivery charge of 90 pounds. Please let me know how you want the damaged chairs "
        "returned. Kind regards, Helen Shaw, office manager, Brightwater Consulting.",
    ),
    Task(
        "summarize-update",
        "summarize",
        "Summarize this project update in two sentences:",
        "Project update, intranet migration, week 9. The team moved 412 of the 530 pages from "
        "the old intranet to the new platform; the remaining pages belong to HR and Legal, who "
        "asked for more time to review their content. Search now works across all migrated "
        "pages, and the first user survey gave it 4.1 out of 5. Single sign-on was delayed by "
        "a certificate problem that the identity team fixed on Tuesday. The go-live date of "
        "30 April still holds, but only if HR and Legal finish their review by 15 April. The "
        "budget is on track, with 82 percent spent. Next week the team will train the "
        "twenty page editors from each department.",
    ),
]

EXTRACT = [
    Task(
        "extract-vpn",
        "extract",
        "Extract name, email, department and the problem from this email as JSON:",
        "From: jonas.weber@northwind-office.example\nSubject: VPN keeps dropping\n\nHi IT, "
        "this is Jonas Weber from Procurement. Since the update last Friday my VPN "
        "connection drops every ten to fifteen minutes when I work from home, and every time "
        "I have to log in again with the code from my phone. My colleagues in Procurement "
        "say theirs is fine. I use the company laptop, model T14, on my home Wi-Fi, and the "
        "connection itself is stable because video calls work without the VPN. Could you "
        "please check my account or the settings on my laptop? I am available all day "
        "tomorrow. Thanks, Jonas",
    ),
    Task(
        "extract-purchase",
        "extract",
        "Extract the requester, items, quantities, total cost and deadline from this request "
        "as JSON:",
        "Purchase request from Sofia Rossi, Marketing. For the trade fair in Lyon we need 250 "
        "printed brochures at 1.20 euros each, 4 roll-up banners at 85 euros each and 500 "
        "branded pens at 0.60 euros each, which makes 940 euros in total including delivery. "
        "The supplier is PrintWorks Lyon, who delivered our material last year without "
        "problems. Everything must arrive at the office by 18 September, because the stand "
        "is built on the 20th and the fair opens on the 21st. The cost goes to the events "
        "budget of the marketing department, cost centre 4410. Please approve by Friday so "
        "the order can go out on Monday.",
    ),
    Task(
        "extract-meeting",
        "extract",
        "Extract the title, date, time, room and attendees of this meeting as JSON:",
        "Hi all, I would like to invite you to the budget review for next year. It will take "
        "place on Wednesday 14 October from 10:00 to 11:30 in meeting room Birch on the "
        "fourth floor. Attendees: Karen Olsen (Finance), Mehmet Yilmaz (Sales), Grace Liu "
        "(Operations), Peter Novak (IT) and me. Please bring your department's draft numbers "
        "and a list of the three investments you consider most important. Coffee and water "
        "will be provided. If you cannot attend, send someone from your team who knows the "
        "numbers and let me know their name by Monday. Best regards, Anna Schmidt, Head of "
        "Controlling.",
    ),
    Task(
        "extract-onboarding",
        "extract",
        "Extract the new employee's name, role, start date, manager and the equipment needed "
        "as JSON:",
        "Onboarding request. Please prepare everything for our new colleague, Ravi Patel, who "
        "joins the Customer Service team as a team lead on 3 June. His manager will be "
        "Claire Dubois. Ravi needs a laptop with a docking station, two monitors, a headset "
        "for phone calls, a mobile phone with a company contract, and access to the ticket "
        "system, the CRM and the shared drive of Customer Service. He will sit at desk 2.07 "
        "next to the window. On his first day he should pick up his badge at reception at "
        "08:30, and Claire will meet him there. Please confirm by the end of next week that "
        "the equipment is ready.",
    ),
    Task(
        "extract-invoice",
        "extract",
        "Extract the vendor, invoice number, amount, currency, due date and what it is for "
        "as JSON:",
        "Dear accounts payable team, please find attached invoice INV-2024-0917 from "
        "CleanSpace Facility Services for the office cleaning in August. The amount due is "
        "3,480.00 euros including VAT, covering daily cleaning of floors one to four, the "
        "window cleaning on 22 August and the extra carpet cleaning you requested after the "
        "summer party. Payment is due by 30 September to the bank account shown on the "
        "invoice. If you have questions about the items, please contact me directly at "
        "billing@cleanspace.example or on 030 555 0192. Thank you for your business. Best "
        "regards, Martin Frey, billing department, CleanSpace Facility Services.",
    ),
    Task(
        "extract-leave",
        "extract",
        "Extract the employee, the type of leave, the first and last day, and who covers the "
        "work as JSON:",
        "Hello Laura, I would like to request annual leave from Monday 4 August to Friday 15 "
        "August, ten working days in total. I have checked the team calendar and nobody else "
        "from Accounts Receivable is away in those weeks. Tobias Wagner has agreed to cover "
        "my open invoices and the daily bank reconciliation while I am away, and I will walk "
        "him through the current reminders on 1 August. The monthly report for July will be "
        "finished before I leave. I will not have access to email during the holiday, so "
        "please contact Tobias for anything urgent. Thank you, Nadia Hussain, Accounts "
        "Receivable.",
    ),
]

REWRITE = [
    Task(
        "rewrite-typos-notice",
        "rewrite",
        "Fix the spelling and grammar, keep everything else:",
        "Dear all, pleese note that the office will be closed on friday 23 december for the "
        "anual maintainance of the heating system. The technicans will arrive at 7 oclock "
        "and they needs access to every room, including the server room and the archive. "
        "Please make sure you're desk is clear and that no valuble items are left on the "
        "floor. The building will open again on Monday at the usual time, and the heating "
        "should work better then it did last winter. If you must come in on friday for an "
        "urgent reason, please tell the facility team before wednesday so they can arange "
        "a visitor badge for you. Thank you for you're understanding.",
    ),
    Task(
        "rewrite-typos-reply",
        "rewrite",
        "Fix the spelling and grammar, keep everything else:",
        "Hello Mr Turner, thank you for you email and sorry for the late reply. I have "
        "checked you're account and I can see that the payment of 240 euro was recieved on "
        "the 12th, but it was booked on the wrong invoice by mistake. I have now corected "
        "this, so the reminder you got last week can be ignored. Your next invoice will be "
        "send at the begining of next month as usual. If you still sees an open amount in "
        "the customer portal after friday, please let me know and I will look into it "
        "imediately. We appologise for the confusion. Kind regards, Sarah Collins, customer "
        "accounts.",
    ),
    Task(
        "rewrite-formal-chat",
        "rewrite",
        "Rewrite in formal tone, keep names:",
        "hey Mark, quick one - the Henderson report is a mess, numbers on page 4 don't match "
        "the spreadsheet Julia sent us and the charts are still the old ones from March. "
        "can you fix that before the call with Henderson tomorrow? they'll spot it for sure. "
        "also Julia says the client wants the summary shorter, like one page max. i'm out "
        "till 2 but ping me if anything's unclear, or just ask Julia, she knows the numbers "
        "better than me anyway. thanks a ton, owe you a coffee. - Ben",
    ),
    Task(
        "rewrite-typos-minutes",
        "rewrite",
        "Fix the spelling and grammar, keep everything else:",
        "Minutes of the safety comittee, 5 April. The comittee discused the results of the "
        "fire drill on 28 March. Evacuation took seven minutes, wich is two minutes longer "
        "then the target, mainly because the stairs on the east side was blocked by boxes. "
        "Facility management will remove the boxes this week and put up new signs. Three "
        "new first aiders has been trained; there names will be posted on the notice board. "
        "The defibrilator in the reception was checked and works correctly. The next drill "
        "will take place in september without warning. The comittee will meet again on 7 "
        "june.",
    ),
    Task(
        "rewrite-formal-complaint",
        "rewrite",
        "Rewrite in formal tone, keep names and dates:",
        "Hi Patricia, honestly we're pretty fed up. Your guys were supposed to fix the air "
        "conditioning on 10 July and nobody showed up. Then on 14 July someone came, poked "
        "around for twenty minutes and left saying they needed a part. It's now 24 July, "
        "it's 29 degrees in our meeting rooms and people are working from home because the "
        "office is unbearable. We pay for a four-hour response in our contract. I need a "
        "date when this gets fixed, and I want to talk about a discount for July. Call me "
        "today. - Robert Evans, office manager",
    ),
    Task(
        "rewrite-typos-faq",
        "rewrite",
        "Fix the spelling and grammar, keep everything else:",
        "How do I reset my password? If you forgot you're password, go to the login page "
        "and click on Forgot password. Enter your work email adress and you will recieve a "
        "link within five minutes. The link is only valid for one hour, so use it strait "
        "away. Your new password must have atleast twelve characters and it can not be the "
        "same as one of your last five passwords. If you dont receive the email, check you're "
        "spam folder first. If it is still missing, call the service desk on extension 4400 "
        "between 8 and 18 oclock, and they will reset it for you after checking you're "
        "identity.",
    ),
]

CODE = [
    Task(
        "code-rename",
        "code",
        "Rename variable x to total in this function and return the code:",
        "```python\n"
        "def invoice_sum(lines, discount=0.0):\n"
        '    """Sum the invoice lines and apply a discount."""\n'
        "    x = 0.0\n"
        "    for line in lines:\n"
        "        if line.get('cancelled'):\n"
        "            continue\n"
        "        x += line['price'] * line['quantity']\n"
        "    if discount:\n"
        "        x = x * (1 - discount)\n"
        "    if x < 0:\n"
        "        raise ValueError('negative invoice total')\n"
        "    if x > 10000:\n"
        "        print('invoice over 10000 needs a second approval:', x)\n"
        "    return round(x, 2)\n"
        "```",
    ),
    Task(
        "code-hints",
        "code",
        "Add type hints to these functions and return the code:",
        "```python\n"
        "def group_by_department(employees, include_inactive=False, prefix=''):\n"
        "    groups = {}\n"
        "    skipped = 0\n"
        "    for employee in employees:\n"
        "        if not employee['active'] and not include_inactive:\n"
        "            skipped += 1\n"
        "            continue\n"
        "        department = prefix + employee['department']\n"
        "        if department not in groups:\n"
        "            groups[department] = []\n"
        "        groups[department].append(employee['name'])\n"
        "    for names in groups.values():\n"
        "        names.sort()\n"
        "    return groups, skipped\n\n\n"
        "def department_sizes(groups, minimum=1):\n"
        "    sizes = {department: len(names) for department, names in groups.items()}\n"
        "    return {department: n for department, n in sizes.items() if n >= minimum}\n"
        "```",
    ),
    Task(
        "code-js-const",
        "code",
        "Replace var with const or let in this JavaScript function and return the code:",
        "```javascript\n"
        "function formatReceipt(items, taxRate) {\n"
        "  var lines = [];\n"
        "  var subtotal = 0;\n"
        "  for (var i = 0; i < items.length; i++) {\n"
        "    var item = items[i];\n"
        "    var cost = item.price * item.quantity;\n"
        "    subtotal += cost;\n"
        "    lines.push(item.name + ': ' + cost.toFixed(2));\n"
        "  }\n"
        "  var tax = subtotal * taxRate;\n"
        "  lines.push('Tax: ' + tax.toFixed(2));\n"
        "  lines.push('Total: ' + (subtotal + tax).toFixed(2));\n"
        "  return lines.join('\\n');\n"
        "}\n"
        "```",
    ),
    Task(
        "code-docstring",
        "code",
        "Add a docstring to this function and return the code:",
        "```python\n"
        "def working_days(start, end, holidays, half_days=()):\n"
        "    if end < start:\n"
        "        raise ValueError('the end date is before the start date')\n"
        "    days = 0.0\n"
        "    current = start\n"
        "    while current <= end:\n"
        "        if current.weekday() < 5 and current not in holidays:\n"
        "            if current in half_days:\n"
        "                days += 0.5\n"
        "            else:\n"
        "                days += 1\n"
        "        current += timedelta(days=1)\n"
        "    if days == 0:\n"
        "        print('no working days between', start, 'and', end)\n"
        "    return days\n"
        "```",
    ),
    Task(
        "code-rename-function",
        "code",
        "Rename the function get_data to load_orders, update every call, and return the code:",
        "```python\n"
        "import csv\n\n\n"
        "def get_data(path):\n"
        "    with open(path, newline='') as f:\n"
        "        return [row for row in csv.DictReader(f) if row['status'] != 'void']\n\n\n"
        "def monthly_report(path, month):\n"
        "    orders = get_data(path)\n"
        "    selected = [o for o in orders if o['date'].startswith(month)]\n"
        "    total = sum(float(o['amount']) for o in selected)\n"
        "    return {'month': month, 'orders': len(selected), 'total': total}\n\n\n"
        "def customers(path):\n"
        "    return sorted({o['customer'] for o in get_data(path)})\n\n\n"
        "def largest_order(path):\n"
        "    return max(get_data(path), key=lambda o: float(o['amount']))\n"
        "```",
    ),
    Task(
        "code-fstring",
        "code",
        "Change this function to use f-strings instead of % formatting and return the code:",
        "```python\n"
        "def reminder_text(name, invoice, amount, days):\n"
        "    greeting = 'Dear %s,' % name\n"
        "    body = 'invoice %s of %.2f euros is %d days overdue.' % (invoice, amount, days)\n"
        "    if days > 30:\n"
        "        body += ' Please pay within 7 days to avoid a late fee.'\n"
        "    elif days > 14:\n"
        "        body += ' Please contact us if you have already paid.'\n"
        "    closing = 'Kind regards,\\nAccounts Receivable'\n"
        "    return '%s\\n\\n%s\\n\\n%s' % (greeting, body, closing)\n"
        "```",
    ),
]

OPEN = [
    Task("open-haiku", "open", "Write a haiku about Monday mornings at the office."),
    Task(
        "open-feedback",
        "open",
        "How can I give critical feedback to a colleague without hurting their feelings?",
    ),
    Task("open-vpn", "open", "Explain what a VPN is to someone who is not technical."),
    Task("open-story", "open", "Write the opening paragraph of a short story about a lighthouse."),
    Task("open-lunch", "open", "Suggest some ideas for a team lunch for ten people."),
    Task("open-interest", "open", "Explain compound interest with a simple example."),
    Task("open-interview", "open", "What should I do to prepare for a job interview?"),
    Task("open-password", "open", "What makes a good password, and why?"),
]

TASKS: list[Task] = [*SUMMARIZE, *EXTRACT, *REWRITE, *CODE, *OPEN]
